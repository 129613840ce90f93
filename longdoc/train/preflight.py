"""What can be checked before any rank starts or any weights load: the model's name and context, the data paths,
the output folder against `resume`. The command lines call these in the parent process (and every launched rank
before its first collective), so bad input costs seconds, not a spawn and a model load (19-44 s at cp=2).

    check_recipe(recipe)                                # train: raises RecipeError / CheckpointError, one line
    check_model(name, seq_len, what=..., extend=...)    # eval: the same model and context checks

Each check reads only a config file and the first record of a data file; the ranks repeat the full checks while
they load, so a check skipped here (a hub dataset id) is still made there.
"""

from __future__ import annotations

from pathlib import Path

from longdoc.train.config import ModelConfig, Recipe, RecipeError


def model_context(mcfg: ModelConfig) -> int | None:
    """The context (positions) the model of `mcfg` will have after any RoPE extension, from its config alone;
    None for a model without position embeddings. A name that cannot be resolved raises as loading would."""
    from longdoc import models
    from longdoc.train.modeling import rope_parameters

    tiny = mcfg.name.startswith(models.TINY_PREFIX)
    if mcfg.overrides and not tiny:
        raise RecipeError("model.overrides applies to tiny:<arch> models only; for a real model, edit a copy of "
                          "its config.json")
    if tiny:
        config = models.tiny_config(models.arch_of(mcfg.name), **{**models.DEFAULT_TOKEN_IDS, **mcfg.overrides})
    else:
        config = models.load_config(mcfg.name, trust_remote_code=mcfg.trust_remote_code)
    if mcfg.rope_type is not None:
        return rope_parameters(config, mcfg)[1]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return int(limit) if limit is not None else None


def check_model(mcfg: ModelConfig, tokens: int, *, what: str, extend: str, shorten: str) -> None:
    """Refuse a model name that does not resolve, or `tokens` positions past its context (training's rule)."""
    from longdoc.train.modeling import check_context

    check_context(tokens, model_context(mcfg), what=what, extend=extend, shorten=shorten)


def check_data_path(path: str, key: str, task: str | None = None, text_field: str | None = None) -> None:
    """`path` exists (or is a hub id, checked where it loads) and, for raw documents read as `task`, its first
    record reads; raises RecipeError naming `key`. Token rows (`longdoc data prepare` output) are checked where
    they load."""
    from longdoc.corpus.ingest import CorpusError, Fields, looks_like_path, read_documents
    from longdoc.train.data import _is_tokenized as is_tokenized  # the loader's own test for token rows

    if path == "random":
        return
    p = Path(path).expanduser()
    if not p.exists():
        if "/" not in path or looks_like_path(path):  # as the loader decides (train.data.load_sequences)
            raise RecipeError(f"{key}: {p} does not exist; make it as the recipe's header says (`longdoc data synth`, "
                              f"`longdoc data plant`, `make retrieval-rows`) or point {key} at your documents")
        return  # a hub dataset id: loading it may need the network, so the ranks check it
    if task is None or is_tokenized(p):
        return
    try:
        next(read_documents([str(p)], task=task, fields=Fields(text=text_field)), None)
    except (CorpusError, ValueError, OSError) as e:
        raise RecipeError(f"data: {e}") from e


def check_recipe(recipe: Recipe) -> None:
    """Every check of a training recipe that needs no rank and no weights; raises the error the ranks would."""
    from longdoc.train import checkpoint

    checkpoint.starting_point(Path(recipe.output_dir) / "checkpoints", recipe.resume, recipe.overwrite)
    check_model(recipe.model, recipe.data.seq_len, what=f"data.seq_len={recipe.data.seq_len}",
                extend="model.rope_type=yarn model.rope_factor={factor}", shorten="shorten data.seq_len")
    data = recipe.data
    if data.path:
        check_data_path(data.path, "data.path", data.task, data.text_field)
    for i, src in enumerate(data.mix):
        if src.source != "rehearsal":  # a rehearsal path is a cache file, made when missing
            check_data_path(src.path, f"data.mix[{i}].path")
    if recipe.eval.path:
        check_data_path(recipe.eval.path, "eval.path", data.task, data.text_field)
