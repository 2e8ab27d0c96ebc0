"""Which adapter a request's KV is computed under, by the adapter's fingerprint (engine.lora.adapter):
what the request's blocks are hashed with, and, for a prompt computed here for another worker, what
that worker runs the request under. Two workers may serve different adapters under one name (one
was reloaded from another directory): pages computed under one must never land where the other
decodes, so a prompt whose adapter here is not the receiver's is refused before anything runs."""

from __future__ import annotations

from engine.lora.registry import AdapterMismatch, AdapterRegistry, UnknownAdapter


def request_fingerprint(registry: AdapterRegistry | None, name: str, expected: bytes | None = None) -> bytes:
    """The fingerprint a request for adapter `name` ("": the base, b"") runs under on this engine
    (`registry`: its adapters, None without --enable-lora). With `expected`, the fingerprint the
    worker it is computed for runs it under: UnknownAdapter naming the adapter where this engine does
    not serve `name`, AdapterMismatch where it serves another adapter under it. Without: ValueError
    naming lora_name on an engine without adapters, UnknownAdapter for a name not served."""
    if expected is not None:
        here = _served(registry, name)
        if here is None:
            raise UnknownAdapter(f"lora_name: this worker serves no adapter {name!r} to compute the prompt under")
        if here != expected:
            raise AdapterMismatch(f"lora_name: adapter {name!r} is {expected.hex()[:16] or 'the base'} at the "
                                  f"receiving worker but {here.hex()[:16] or 'the base'} here: its pages would "
                                  "be another adapter's")
        return here
    if not name:
        return b""
    if registry is None:
        raise ValueError(f"lora_name: {name!r}, but this engine serves no adapters (--enable-lora)")
    return registry.fingerprint(name)


def _served(registry: AdapterRegistry | None, name: str) -> bytes | None:
    """The fingerprint `name` is served with here (b"" for the base), None if it is not served."""
    if not name:
        return b""
    if registry is None or name not in registry.known:
        return None
    return registry.known[name].fingerprint
