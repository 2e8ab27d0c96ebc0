"""The composition root of an engine: the engine `config` asks for, with the speculation proposer it names."""

from __future__ import annotations

from engine.config import EngineConfig
from engine.engine import Engine
from engine.model.loader import ModelFiles
from engine.speculative.draft_model import DraftModel, DraftModelProposer
from engine.speculative.ngram import NgramProposer


def build_engine(config: EngineConfig, files: ModelFiles | None = None) -> Engine:
    """An engine on `config` (and already loaded `files`, see Engine), drafting with the n-gram
    proposer or the draft model `config.speculative` names. ValueError naming the flag for a draft
    that cannot serve this target, as Engine's for the target itself."""
    spec = config.speculative
    if spec is None:
        return Engine(config, files)
    if spec.method == "ngram":
        return Engine(config, files, NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
    draft = DraftModel(spec, config)
    engine = Engine(config, files, DraftModelProposer(draft))
    try:
        draft.check_vocabulary(engine.tokenizer, engine.model_config.vocab_size)
    except ValueError:
        engine.close()
        raise
    return engine
