"""Hugging Face Hub ids where paths go: ``ORG/NAME`` models and ``hf://datasets/...`` files.

Everything goes through ``huggingface_hub``, so its cache (``HF_HOME`` /
``HF_HUB_CACHE``), ``HF_HUB_OFFLINE=1`` and tokens behave as in transformers, TRL, verl
and vLLM: a cluster that pre-downloads into the cache and runs offline needs nothing
else. What cannot be resolved (an id absent from the cache offline, a repository or file
that does not exist, a gated one) is one line naming the id and what to do.

- A model id is ``ORG/NAME`` or ``ORG/NAME@REVISION``; its snapshot (config, weights,
  tokenizer) is a local directory loaded like any other.
- A dataset file is ``hf://datasets/ORG/NAME[@REVISION]/PATH-IN-REPO`` (the form
  huggingface_hub's file system, pandas and DuckDB read); ``PATH-IN-REPO`` may be a glob
  (``main/train-*.parquet``), whose files are read in name order.
"""

from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path

from fp4rl.errors import UserError

#: ``ORG/NAME`` with an optional ``@REVISION``
_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?$")
_DATASET_URL = re.compile(r"^hf://datasets/(?P<repo>[^/@]+/[^/@]+)(@(?P<rev>[^/]+))?/"
                          r"(?P<path>.+)$")
#: the files a model snapshot needs (no other formats' weights, no images or READMEs)
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "tokenizer*"]


class HubError(UserError):
    """A Hub id or file that cannot be resolved; the message says what to do."""


def is_model_id(text: str) -> bool:
    """Whether ``text`` reads as a Hub model id (and is not a local path)."""
    return bool(_MODEL_ID.match(text)) and not Path(text).expanduser().exists()


def is_dataset_url(text: str | os.PathLike[str]) -> bool:
    return str(text).startswith("hf://")


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _advice(what: str, download: str) -> str:
    from huggingface_hub import constants

    if _offline():
        return (f"{what} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) and "
                f"HF_HUB_OFFLINE is set: download it where the Hub is reachable "
                f"(`{download}`) into the same HF_HOME, or unset HF_HUB_OFFLINE")
    return (f"{what} could not be fetched from the Hub: check the id, your network and, "
            f"for a gated or private repository, HF_TOKEN (`hf auth login`); or download "
            f"it first (`{download}`)")


def model_snapshot(model_id: str) -> Path:
    """The local snapshot directory of ``ORG/NAME[@REVISION]`` (fetched into the cache
    unless offline)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    repo, _, revision = model_id.partition("@")
    try:
        path = Path(snapshot_download(repo, revision=revision or None,
                                      allow_patterns=MODEL_FILES))
    except (EntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        why = _advice(f"model {model_id!r}", f"hf download {repo}")
        raise HubError(f"{why} ({type(err).__name__}; no local directory {model_id!r} "
                       "exists either)") from None
    if not (path / "config.json").is_file():
        raise HubError(f"model {model_id!r}: its snapshot {path} has no config.json, so it is "
                       "not a Hugging Face checkpoint (a GGUF-only repository?)")
    return path


def dataset_files(url: str) -> list[Path]:
    """The local files ``hf://datasets/ORG/NAME[@REVISION]/PATH`` names (a glob: every
    match, in name order)."""
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError

    match = _DATASET_URL.match(url)
    if match is None:
        raise HubError(f"{url!r} is not a Hub dataset file: write "
                       "hf://datasets/ORG/NAME/PATH-IN-REPO (PATH may be a glob)")
    repo, revision, path = match["repo"], match["rev"], match["path"]
    download = f"hf download {repo} --repo-type dataset"
    try:
        if not any(c in path for c in "*?["):
            return [Path(hf_hub_download(repo, path, repo_type="dataset", revision=revision))]
        root = Path(snapshot_download(repo, repo_type="dataset", revision=revision,
                                      allow_patterns=[path]))
    except (EntryNotFoundError, HfHubHTTPError, OSError, ValueError) as err:
        why = _advice(f"dataset file {url!r}", download)
        raise HubError(f"{why} ({type(err).__name__})") from None
    files = sorted(p for p in root.rglob("*") if p.is_file()
                   and fnmatch.fnmatch(p.relative_to(root).as_posix(), path))
    if not files:
        where = (f" in the offline cache: download them where the Hub is reachable "
                 f"(`{download} --include '{path}'`)" if _offline() else "")
        raise HubError(f"{url!r}: no file of {repo} matches {path!r}{where}")
    return files


__all__ = ["MODEL_FILES", "HubError", "dataset_files", "is_dataset_url", "is_model_id",
           "model_snapshot"]
