"""verl's way of starting vLLM, with the ``fp4rl`` method: engine arguments as ``vllm
serve`` flags.

verl 0.9.1's vLLM server (``vLLMHttpServer.launch_server``) does not call
``vllm.LLM(**kwargs)``, as the other tests here do. It lays the user's
``actor_rollout_ref.rollout.engine_kwargs.vllm`` over a dict of its own rollout settings
(whose ``quantization`` and ``hf_overrides`` are None and ``{}``), turns the dict into
``vllm serve`` flags (``build_cli_args_from_config``: ``--key value`` under the dict's
own underscored key, a dict as JSON, True as ``--key``, False as ``--no-key`` where
leaving it out would mean True, None left out), parses them with vLLM's own ``serve``
parser and builds the engine from ``AsyncEngineArgs.from_cli_args``.

That path is taken here with the engine arguments fp4rl's verl hook gives
(:func:`fp4rl.integrations.verl.engine_kwargs`: ``--quantization fp4rl --hf_overrides
JSON``): vLLM's parser must give the engine arguments the keyword path gives, field for
field, and the engine config built from them must run the recipe's rollout policy, with
the actor's ``FP4RL_RECIPE`` checked against it. verl's two steps are written here from
the behaviour described above (verl's vLLM extra needs GPUs, so verl itself is not
installed beside vLLM here; the steps live in verl's
``verl/workers/rollout/vllm_rollout/{vllm_async_server,utils}.py``)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, get_args

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed; `make test-vllm` runs "
                           "these tests in an environment of its own")

from fp4rl.integrations import verl  # noqa: E402
from fp4rl.integrations.vllm import RECIPE_ENV, model_dir  # noqa: E402
from fp4rl.nn.recipe import get_recipe  # noqa: E402
from fp4rl.rollout.vllm.config import recipe_from_config  # noqa: E402
from fp4rl.rollout.vllm.errors import VLLMError  # noqa: E402
from fp4rl.rollout.vllm.host import encode_recipe  # noqa: E402

RECIPE = "hif4+resq-2:4"


def verl_settings() -> dict[str, Any]:
    """The settings verl's server passes before the user's engine arguments, with the
    values of the documented command (``docs/integrations.md``, section verl) where it sets
    them and verl's defaults elsewhere; on a CPU: no sleep mode, eager, 128 tokens."""
    return {
        "dtype": "bfloat16", "load_format": "dummy", "skip_tokenizer_init": False,
        "distributed_executor_backend": "mp", "trust_remote_code": False,
        "max_model_len": 128, "max_num_seqs": 1024, "enable_chunked_prefill": True,
        "max_num_batched_tokens": 8192, "enable_prefix_caching": True,
        "enable_sleep_mode": False, "logprobs_mode": "processed_logprobs",
        "enforce_eager": True, "gpu_memory_utilization": 0.5, "disable_log_stats": True,
        "tensor_parallel_size": 1, "seed": 0,
        "override_generation_config": json.dumps({"temperature": 1.0, "top_p": 1.0,
                                                  "top_k": -1}),
        "quantization": None, "hf_overrides": {}, "scheduling_policy": "fcfs",
        "compilation_config": json.dumps({"cudagraph_mode": "FULL_AND_PIECEWISE"}),
    }


def optional_bools() -> set[str]:
    """verl's ``_optional_bool_vllm_args``: the flags whose False is written out."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return {f.name for f in dataclasses.fields(AsyncEngineArgs)
            if set(get_args(f.type)) == {bool, type(None)}
            or (f.type is bool and (f.default is None or f.default is True))}


def cli_flags(config: dict[str, Any]) -> list[str]:
    """verl's ``build_cli_args_from_config``."""
    flags: list[str] = []
    for key, value in config.items():
        if value is None:
            continue
        if isinstance(value, bool):
            if value:
                flags.append(f"--{key}")
            elif key.replace("-", "_") in optional_bools():
                flags.append(f"--no-{key}")
        elif isinstance(value, list):
            if value:
                flags += [f"--{key}", *map(str, value)]
        else:
            flags += [f"--{key}", json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


def serve_engine_args(model: str, config: dict[str, Any]):
    """verl's start: ``serve MODEL FLAGS`` through vLLM's CLI parser, then
    ``AsyncEngineArgs.from_cli_args``."""
    import vllm.entrypoints.cli.serve
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    for cmd in vllm.entrypoints.cli.serve.cmd_init():
        cmd.subparser_init(subparsers).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(["serve", model, *cli_flags(config)])
    args.model = args.model_tag
    return AsyncEngineArgs.from_cli_args(args)


@pytest.fixture(scope="module")
def model() -> str:
    return str(model_dir("smollm2-135m"))


def test_the_flags_verl_writes(model):
    kwargs = verl.engine_kwargs(RECIPE)
    flags = cli_flags({**verl_settings(), **kwargs})
    at = flags.index("--quantization")
    assert flags[at + 1] == "fp4rl"
    at = flags.index("--hf_overrides")
    assert json.loads(flags[at + 1]) == kwargs["hf_overrides"]
    assert flags.count("--quantization") == flags.count("--hf_overrides") == 1


def test_vllms_parser_gives_the_engine_arguments_of_the_keyword_path(model):
    """Every field as verl's settings alone give it, but ``quantization`` and
    ``hf_overrides``, which are the hook's values as ``vllm.LLM(**engine_kwargs)``
    passes them."""
    kwargs = dict(verl.engine_kwargs(RECIPE))
    served = serve_engine_args(model, {**verl_settings(), **kwargs})
    base = serve_engine_args(model, verl_settings())
    assert base.quantization is None and base.hf_overrides in ({}, None)
    for field in dataclasses.fields(served):
        want = kwargs.get(field.name, getattr(base, field.name))
        assert getattr(served, field.name) == want, field.name


def test_the_engine_config_runs_the_recipe_and_checks_the_actors(model, monkeypatch):
    monkeypatch.setenv(RECIPE_ENV, encode_recipe(get_recipe(RECIPE)))  # verl's workers have it
    served = serve_engine_args(model, {**verl_settings(), **verl.engine_kwargs(RECIPE)})
    config = served.create_engine_config()
    assert config.model_config.quantization == "fp4rl"
    entry = config.model_config.hf_config.quantization_config
    assert recipe_from_config(entry).rollout == get_recipe(RECIPE).rollout
    quant = config.quant_config
    assert quant is not None and quant.get_name() == "fp4rl"
    # an engine asked for another recipe than the actor trains is refused as vLLM reads
    # it (vLLM 0.32 wraps the error in its config's pydantic ValidationError, a ValueError)
    other = serve_engine_args(model, {**verl_settings(), **verl.engine_kwargs("hif4")})
    with pytest.raises((VLLMError, ValueError),
                       match=rf"but the actor's {RECIPE_ENV} rolls out .*python -m "
                       r"fp4rl\.integrations\.verl --recipe R"):
        other.create_engine_config()


def test_a_refusal_inside_vllms_config_reaches_fp4rls_engine_caller_as_one_line(
        model, monkeypatch):
    """vLLM 0.32 reads the quantization config while it validates its pydantic config:
    fp4rl's refusal there (an engine recipe other than the actor's) would reach the user
    inside a many-line ValidationError; where fp4rl builds the engine it is its one line."""
    from fp4rl.integrations.vllm import EngineSpec, make_llm

    monkeypatch.setenv(RECIPE_ENV, encode_recipe(get_recipe(RECIPE)))
    with pytest.raises(VLLMError) as refused:
        make_llm(EngineSpec(model, get_recipe("hif4"), max_model_len=128))
    assert len(str(refused.value).splitlines()) == 1
    assert f"but the actor's {RECIPE_ENV} rolls out" in str(refused.value)
