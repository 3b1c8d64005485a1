"""TorchTitan adapter, in process: the flag, the config functions, the CPU fixes, stage programs."""
import pytest
import torch

pytest.importorskip("torchtitan")

from torchtitan.config import ConfigManager  # noqa: E402
from torchtitan.distributed.pipeline_parallel import _generate_llm_fqn_per_model_part, _split_module  # noqa: E402

from piper_plugin.adapters.torchtitan import config_registry  # noqa: E402
from piper_plugin.adapters.torchtitan.cpu import ASSETS, DATASET  # noqa: E402
from piper_plugin.adapters.torchtitan.pipelining import _compile, _schedule_fn, recipe_for  # noqa: E402
from piper_plugin.adapters.torchtitan.program import build_stage_program  # noqa: E402
from piper_plugin.runtime.executor import HostOptimizer  # noqa: E402
from piper_plugin.adapters.torchtitan.trainer import PiperTrainer  # noqa: E402
from piper_plugin.api.errors import DirectiveError  # noqa: E402

MODULE = "piper_plugin.adapters.torchtitan"


def _parse(*args):
    return ConfigManager().parse_args(["--module", MODULE, "--config", "llama3_debugmodel", *args])


def test_stock_config_functions_are_reachable_by_their_own_names():
    for name in ("llama3_debugmodel", "llama3_debugmodel_ce_loss", "deepseek_v3_debugmodel"):
        config = getattr(config_registry, name)()
        assert isinstance(config, PiperTrainer.Config)
        assert config.parallelism.pipeline_engine == "torch"
    with pytest.raises(AttributeError, match="no TorchTitan config function"):
        config_registry.not_a_config


def test_cpu_fixes_are_in_the_config():
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

    config = config_registry.deepseek_v3_debugmodel()
    seen = []

    def walk(node, depth=0):
        if depth > 12:
            return
        if isinstance(node, (FlexAttention.Config, ScaledDotProductAttention.Config)):
            seen.append(type(node))
        import dataclasses
        if dataclasses.is_dataclass(node):
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name, None), depth + 1)
        elif isinstance(node, list):
            for v in node:
                walk(v, depth + 1)

    walk(config.model_spec.model)
    assert seen and all(issubclass(t, ScaledDotProductAttention.Config) for t in seen)
    assert config.training.mixed_precision_param == "float32"
    assert config.training.disable_cuda_graphs
    assert config.hf_assets_path == str(ASSETS) and (ASSETS / "tokenizer.json").is_file()
    assert config.dataloader.dataset == DATASET


def test_engine_flag_parses_and_rejects_bad_values(capsys):
    assert _parse().parallelism.pipeline_engine == "torch"
    config = _parse("--parallelism.pipeline_engine", "piper", "--piper.recipe", "zb-h1")
    assert config.parallelism.pipeline_engine == "piper" and config.piper.recipe == "zb-h1"
    assert _parse("--parallelism.pipeline_engine=piper").parallelism.pipeline_engine == "piper"
    with pytest.raises(SystemExit) as exit_:
        _parse("--parallelism.pipeline_engine", "megatron")
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice 'megatron'" in err and "'torch', 'piper', 'alternate'" in err, err


def test_drop_in_configs():
    config = config_registry.llama3_debugmodel_pp2_interleaved()
    assert config.parallelism.pipeline_engine == "piper"
    assert config.parallelism.pipeline_parallel_degree == 2
    assert config.parallelism.pipeline_parallel_schedule == "Interleaved1F1B"
    assert config_registry.llama3_debugmodel_pp2_1f1b().parallelism.pipeline_parallel_schedule == "1F1B"


def test_schedule_names_map_to_recipes():
    assert recipe_for("1F1B") == "1f1b"
    assert recipe_for("Interleaved1F1B") == "interleaved-1f1b"
    assert recipe_for("GPipe") == "gpipe"
    assert recipe_for("DualPipeV") == recipe_for("ZBVZeroBubble") == "dualpipev"
    with pytest.raises(ValueError, match="--piper.recipe"):
        recipe_for("NoSuchSchedule")


def _llama_parts(stages):
    spec = config_registry.llama3_debugmodel().model_spec
    with torch.device("meta"):
        model = spec.model.build()
    fqns = _generate_llm_fqn_per_model_part(stages, len(spec.model.layers), 1, 1)
    return [_split_module(model, names) for names in fqns], spec.model.dim


@pytest.mark.parametrize("recipe, stages, rank0", [("1f1b", 2, {0}), ("interleaved-1f1b", 4, {0, 2}),
                                                    ("dualpipev", 4, {0, 3}), ("zb-h1", 2, {0})])
def test_stage_program_places_stages_as_torchtitan_does(recipe, stages, rank0):
    parts, dim = _llama_parts(stages)
    program = build_stage_program(parts, microbatch_size=1, microbatches=4, seq_len=32, hidden_dim=dim,
                                  dtype=torch.float32)
    assert [program.regions[str(s)].inputs[0] for s in range(stages)] == ["tokens"] + [f"h{s}" for s in range(stages - 1)]
    assert program.regions[str(stages - 1)].outputs == ("loss",)
    _, apply = _schedule_fn(recipe, pp=2, microbatches=4, stages=stages)
    plan = _compile(program, apply, 2, True).plan
    placement = plan.dag.meta.placement
    assert {int(r) for r, p in placement.items() if p == 0} == rank0
    # one replica: nothing to reduce in the plan (TorchTitan's FSDP reduces, its optimizer steps)
    assert not any(n.kind.value in ("ALL_REDUCE", "REDUCE_SCATTER", "ALL_GATHER") for n in plan.dag.nodes.values())
    assert any(n.kind.value == "UPDATE" for n in plan.dag.nodes.values())


def test_recipe_that_does_not_fit_the_stages_is_named():
    parts, dim = _llama_parts(2)
    program = build_stage_program(parts, microbatch_size=1, microbatches=4, seq_len=32, hidden_dim=dim,
                                  dtype=torch.float32)
    _, apply = _schedule_fn("dualpipev", pp=2, microbatches=4, stages=2)
    with pytest.raises(DirectiveError, match=r"dualpipev\(pp=2, chunks=2\): the model has 2 PP stages but the "
                                             r"recipe needs pp x chunks = 4"):
        _compile(program, apply, 2, True)


def test_host_optimizer_leaves_gradients_for_torchtitan():
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 3.0)
    opt = HostOptimizer([p])
    opt.step()
    opt.zero_grad(set_to_none=True)
    assert torch.equal(p.grad, torch.full((2,), 3.0)) and torch.equal(p.detach(), torch.ones(2))


def test_recipe_file_is_loaded(tmp_path):
    path = tmp_path / "my_recipe.py"
    path.write_text("from piper_plugin.recipes import apply_recipe\n"
                    "def recipe(sch, microbatches, **kw):\n"
                    "    apply_recipe(sch, 'gpipe', microbatches=microbatches)\n")
    parts, dim = _llama_parts(2)
    program = build_stage_program(parts, microbatch_size=1, microbatches=2, seq_len=32, hidden_dim=dim,
                                  dtype=torch.float32)
    label, apply = _schedule_fn(str(path), pp=2, microbatches=2, stages=2)
    assert label == "my_recipe.py"
    assert _compile(program, apply, 2, True).plan.microbatches == 2
