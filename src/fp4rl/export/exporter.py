"""``export_checkpoint``, ``export_pretrained``, ``export_model``: a policy others can load."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from fp4rl.export.directory import (
    bf16_bytes,
    check_output,
    total_bytes,
    weights_bytes,
    write_directory,
)
from fp4rl.export.registry import get_export_format, list_export_formats
from fp4rl.export.vllm import (
    RUN_RECIPE,
    check_takes_recipe,
    default_vllm_recipe,
    read_recipe,
    vllm_recipe,
)
from fp4rl.nn.recipe import Recipe

#: the built-in export formats' names (:func:`list_export_formats` also lists those
#: registered later)
EXPORT_FORMATS = tuple(list_export_formats())


@dataclass(frozen=True)
class ExportResult:
    """Where an export went and what it weighs on disk."""

    format: str
    directory: Path
    weights_bytes: int
    total_bytes: int
    #: what the same tensors take in bf16 (2 bytes per parameter, tied ones once)
    bf16_bytes: int

    @property
    def ratio(self) -> float:
        """Size of the weights on disk relative to the bf16 export's."""
        return self.weights_bytes / self.bf16_bytes

    def summary(self) -> str:
        """One line for the command line."""
        note = ("; block linears as their packed rollout Q(W), installed by vLLM as they are"
                if self.format == "vllm" else "")
        return (f"{self.format} export in {self.directory}: weights {_mb(self.weights_bytes)} "
                f"on disk ({self.ratio:.3f}x the bf16 export's {_mb(self.bf16_bytes)}); "
                f"directory {_mb(self.total_bytes)}{note}")


def check_format(fmt: str) -> str:
    """The export format named ``fmt`` (case-insensitive), its dependencies checked, or
    one line saying what is accepted."""
    return get_export_format(fmt).name


def export_checkpoint(checkpoint: str | Path, fmt: str, output: str | Path,
                      recipe: str | Recipe | None = None) -> ExportResult:
    """Export a training run's latest checkpoint (or the checkpoint ``checkpoint``) in
    ``fmt`` to the new directory ``output``.

    The layers the run quantized (every block linear, minus its recipe's ``ignore``) are
    quantized; the rest stays bf16. ``vllm``: ``recipe`` is the rollout recipe vLLM runs
    (a recipe name, a Recipe, or ``"run"`` for the run's own; default
    ``hif4+resq-2:4``), and the run's ``ignore`` is added to its own. Bad arguments fail
    before the model is loaded."""
    from fp4rl.rl.sources import load_trained

    name = check_format(fmt)
    from_run = recipe == RUN_RECIPE
    if from_run:
        check_takes_recipe(name)
    given = None if from_run else read_recipe(name, recipe)
    check_output(Path(output))
    trained = load_trained(checkpoint)
    rollout = None
    if name == "vllm":
        rollout = vllm_recipe(trained.recipe if from_run else given or default_vllm_recipe(),
                              run_ignore=trained.recipe.ignore)
    ignores = trained.recipe.ignores_in(n for n, _ in trained.model.named_modules())
    # a checkpoint's policy is a transformers model (TrainedPolicy types it as a Module)
    return _export(cast(PreTrainedModel, trained.model), trained.tokenizer, name, Path(output),
                   ignores, rollout)


def export_pretrained(model: str, fmt: str, output: str | Path,
                      recipe: str | Recipe | None = None) -> ExportResult:
    """Export a registered model or a Hugging Face directory (as ``load_model`` takes it),
    untrained, in ``fmt`` to the new directory ``output`` (``recipe``: as in
    :func:`export_checkpoint`, ``vllm`` only)."""
    from fp4rl.models import load_model

    name = check_format(fmt)
    rollout = read_recipe(name, recipe)
    check_output(Path(output))
    return _export(*load_model(model), name, Path(output), lambda name: False, rollout)


def export_model(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, fmt: str,
                 output: str | Path,
                 ignores: Callable[[str], bool] = lambda name: False,
                 recipe: str | Recipe | None = None) -> ExportResult:
    """Export ``model`` (any causal LM ``fp4rl.quantize_model`` can patch) in ``fmt``.

    ``bf16``: a plain Hugging Face directory. ``mxfp4`` / ``nvfp4``: a compressed-tensors
    checkpoint. ``hif4``: fp4rl's packed directory. In the three 4-bit formats each block
    linear not matched by ``ignores`` is quantized along in_features exactly as
    ``fp4rl.quantize(w, fmt, dim=-1)`` does; everything else is stored in bf16.

    ``vllm``: a Hugging Face directory that vLLM, with fp4rl installed, serves as the
    rollout policy of ``recipe`` (default ``hif4+resq-2:4``; its ``ignore``, not
    ``ignores``, says which linears stay unquantized). The block linears that the recipe
    quantizes are stored in float32, 4 bytes per parameter (twice bf16): vLLM quantizes
    them when it loads them, from the same float32 master values fp4rl's own rollout
    quantizes, so the served policy equals fp4rl's layer for layer, bit for bit. Rounding
    them to bf16 first would move values across FP4 rounding boundaries and block scales.
    Everything else is stored in bf16."""
    name = check_format(fmt)
    rollout = read_recipe(name, recipe)  # read in once: the payload takes it
    return _export(model, tokenizer, name, Path(output), ignores, rollout)


def _export(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, name: str,
            directory: Path, ignores: Callable[[str], bool], rollout: Recipe | None
            ) -> ExportResult:
    """:func:`export_model` once its arguments are read and checked: ``name`` an export
    format's, ``rollout`` the checked recipe (None: the default of a format that takes
    one)."""
    check_output(directory)
    export = get_export_format(name)
    if export.takes_recipe and rollout is None:
        rollout = default_vllm_recipe()
    payload = export.payload(model, ignores, rollout)
    write_directory(directory, model, tokenizer, payload)
    return ExportResult(name, directory, weights_bytes(directory), total_bytes(directory),
                        bf16_bytes(model))


def _mb(size: int) -> str:
    return f"{size / 1e6:.1f} MB"
