"""Load local dataset files (jsonl or parquet) into :class:`Example` lists via a Layout.

Bad records are never repaired by guessing: each one is reported with its position
(``line N``, counted from 1, for jsonl; ``row N``, counted from 0 as in pyarrow and
pandas, for parquet) and skipped with a :class:`DataWarning`, or raised as a
:class:`DataError` when ``strict=True``.
"""

from __future__ import annotations

import functools
import json
import math
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from fp4rl.data.example import Example, Message
from fp4rl.data.layouts import Layout, get_layout
from fp4rl.errors import MissingFileError, UserError


class DataError(UserError):
    """A dataset file (or, with ``strict=True``, one of its records) cannot be used."""


class DataWarning(UserWarning):
    """A record was skipped because it cannot be used."""


class _BadRecord(ValueError):
    """Why one record was rejected; the loader adds where it is."""


_MISSING = object()
_FIELD_KEYS = frozenset({"problem", "answer"})

Record = Mapping[str, object]
"""A decoded record: named fields of any value, none of them checked yet."""
_Raw = TypeVar("_Raw")


# --------------------------------------------------------------------------- file formats


@dataclass(frozen=True)
class _Format(Generic[_Raw]):
    """How to walk one file type: raw records with their 0-based index, and decode one.

    ``unit`` and ``first_number`` say how positions are shown to people: "line 1" is the
    first line of a text file, "row 0" the first row of a table.
    """

    unit: str
    first_number: int
    records: Callable[[Path], Iterator[tuple[int, _Raw]]]
    decode: Callable[[_Raw], Record]

    def read(self, path: Path) -> Iterator[tuple[int, Callable[[], Record]]]:
        """Each raw record's index, and the call that decodes it: a record that does not
        decode raises :class:`_BadRecord` when it is called, where the loader reports it."""
        for index, raw in self.records(path):
            yield index, functools.partial(self.decode, raw)


def _jsonl_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with path.open("rb") as handle:
        for index, line in enumerate(handle):
            if line.strip():
                yield index, line


def _decode_json_line(line: bytes) -> Record:
    try:
        record = json.loads(line.decode("utf-8-sig"))
    except UnicodeDecodeError as err:
        raise _BadRecord(f"not valid UTF-8 ({err.reason})") from None
    except json.JSONDecodeError as err:
        raise _BadRecord(f"invalid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise _BadRecord(f"expected a JSON object, got {type(record).__name__}")
    return record


def _parquet_rows(path: Path) -> Iterator[tuple[int, Record]]:
    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        yield from enumerate(record for batch in batches for record in batch.to_pylist())
    except pa.ArrowException as err:
        raise DataError(f"{path}: unreadable parquet file ({err})") from err


def _as_record(record: Record) -> Record:
    return record


_FILE_READERS: dict[str, _Format[bytes] | _Format[Record]] = {
    ".jsonl": _Format("line", 1, _jsonl_lines, _decode_json_line),
    ".parquet": _Format("row", 0, _parquet_rows, _as_record),
}


def _format_of(path: Path) -> _Format[bytes] | _Format[Record]:
    if not path.is_file():
        raise MissingFileError(f"dataset file not found: {path}")
    try:
        return _FILE_READERS[path.suffix.lower()]
    except KeyError:
        choices = ", ".join(_FILE_READERS)
        raise DataError(f"{path}: unsupported file type; expected one of {choices}") from None


# --------------------------------------------------------------------------- records


def _lookup(record: Record, name: str) -> object:
    """A field by exact name, else by dotted path through nested dicts; _MISSING if absent."""
    if name in record:
        return record[name]
    value: object = record
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _first_field(record: Record, candidates: tuple[str, ...]) -> tuple[str, object]:
    for name in candidates:
        value = _lookup(record, name)
        if value is not _MISSING:
            return name, value
    wanted = " or ".join(repr(name) for name in candidates)
    raise _BadRecord(f"missing field {wanted}")


def _problem_text(name: str, value: object) -> str:
    if not isinstance(value, str) or not value.strip():
        raise _BadRecord(f"field {name!r} must be non-empty text, got {_describe(value)}")
    return value


def _messages(name: str, value: object) -> tuple[Message, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise _BadRecord(f"field {name!r} must be a non-empty message list, got {_describe(value)}")
    return tuple(_message(name, position, turn) for position, turn in enumerate(value))


def _message(name: str, position: int, turn: object) -> Message:
    if not isinstance(turn, Mapping):
        raise _BadRecord(f"{name}[{position}] must be a {{role, content}} object")
    role, content = turn.get("role"), turn.get("content")
    if not isinstance(role, str) or not isinstance(content, str) or not content.strip():
        raise _BadRecord(f"{name}[{position}] needs text 'role' and non-empty 'content'")
    return {"role": role, "content": content}


def _answer_text(name: str, value: object) -> str:
    """Stored answers are text or numbers (AIME: int, AMC: float such as 27.0)."""
    if isinstance(value, str):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        return str(int(value)) if value.is_integer() else repr(value)
    raise _BadRecord(f"field {name!r} must be text or a number, got {_describe(value)}")


def _describe(value: object) -> str:
    if isinstance(value, str):
        return "text" if value.strip() else "empty text"
    return "null" if value is None else type(value).__name__


def _answer(layout: Layout, record: Record) -> str:
    name, value = _first_field(record, layout.answer_fields)
    text = _answer_text(name, value)
    try:
        answer = layout.extract_answer(text).strip()
    except ValueError as err:
        raise _BadRecord(f"field {name!r}: {err}") from None
    if not answer:
        raise _BadRecord(f"field {name!r} holds an empty answer")
    return answer


def _meta(layout: Layout, record: Record) -> dict[str, object]:
    meta: dict[str, object] = {}
    for name in layout.meta_fields:
        value = _lookup(record, name)
        if value is not _MISSING and value is not None:
            meta[name] = value
    return meta


def record_to_example(layout: Layout, record: Record, index: int) -> Example:
    """Build an Example from one decoded record; raises ``ValueError`` if it is unusable."""
    name, value = _first_field(record, layout.problem_fields)
    prompt = _messages(name, value) if layout.chat_prompt else _problem_text(name, value)
    return Example(
        prompt=prompt,
        answer=_answer(layout, record),
        reward=layout.reward,
        source=layout.name,
        index=index,
        meta=_meta(layout, record),
    )


# --------------------------------------------------------------------------- loading


def _resolve(layout: Layout | str, fields: Mapping[str, str] | None) -> Layout:
    spec = get_layout(layout) if isinstance(layout, str) else layout
    if not fields:
        return spec
    unknown = set(fields) - _FIELD_KEYS
    if unknown:
        raise DataError(f"unknown field mapping keys {sorted(unknown)}; use 'problem', 'answer'")
    return spec.with_fields(problem=fields.get("problem"), answer=fields.get("answer"))


def load_examples(
    layout: Layout | str,
    path: str | Path,
    *,
    fields: Mapping[str, str] | None = None,
    strict: bool = False,
    limit: int | None = None,
) -> list[Example]:
    """Read a ``.jsonl`` or ``.parquet`` file laid out as ``layout``.

    Args:
        layout: a dataset name (see ``LAYOUTS``) or a custom :class:`Layout`.
        path: a local file, or a Hub file ``hf://datasets/ORG/NAME[@REV]/PATH-IN-REPO``
            read through huggingface_hub's cache (``PATH`` may be a glob: every match, in
            name order, as one dataset); its suffix picks the reader.
        fields: ``{"problem": ..., "answer": ...}`` field names overriding the layout's
            candidates, for releases that renamed them.
        strict: raise :class:`DataError` on the first bad record instead of skipping it.
        limit: stop after this many good examples.

    Returns:
        The examples in file order; ``Example.index`` is the record's 0-based position
        (across the files of a glob). A dataset without a single usable record raises
        :class:`DataError`; bad records are reported by file and line or row, wherever
        the file came from.
    """
    from fp4rl.hub import dataset_files, is_dataset_url

    spec = _resolve(layout, fields)
    files = dataset_files(str(path)) if is_dataset_url(path) else [Path(path)]
    formats = [(f, _format_of(f)) for f in files]
    examples: list[Example] = []
    skipped: list[str] = []
    offset = 0
    for file, file_format in formats:
        count = 0
        for index, decode in file_format.read(file):
            count = index + 1
            if limit is not None and len(examples) >= limit:
                break
            try:
                examples.append(record_to_example(spec, decode(), offset + index))
            except _BadRecord as err:
                where = f"{file_format.unit} {index + file_format.first_number}"
                if strict:
                    raise DataError(f"{file}: {where}: {err}") from None
                skipped.append(f"{file}: {where}: {err}")
        offset += count
        if limit is not None and len(examples) >= limit:
            break
    if not examples:  # nothing to train or score on: one error, not a warning per row
        why = (f"all {len(skipped)} records skipped; first: {skipped[0]}" if skipped
               else "no records")
        raise DataError(f"{path}: no usable {spec.name} examples ({why})")
    for message in skipped:
        warnings.warn(f"{message}; skipped", DataWarning, stacklevel=2)
    return examples
