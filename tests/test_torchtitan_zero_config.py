"""Piper's ZeRO inside TorchTitan, in process: the drop-in names, the level from TorchTitan's
own knob or ``--piper.zero``, and every mesh Piper cannot run refused by its flag."""
from types import SimpleNamespace

import pytest

pytest.importorskip("torchtitan")

from torchtitan.config import ConfigManager  # noqa: E402

from piper_plugin.adapters.torchtitan import config_registry  # noqa: E402
from piper_plugin.adapters.torchtitan.config_names import drop_in, unknown  # noqa: E402
from piper_plugin.adapters.torchtitan.zero import check_parallelism, zero_level  # noqa: E402


def test_zero_drop_ins_are_reachable_by_name():
    for level in (1, 2, 3):
        config = getattr(config_registry, f"llama3_debugmodel_pp2_dp2_zero{level}")()
        assert config.parallelism.pipeline_engine == "piper" and config.piper.zero == level
        assert config.parallelism.pipeline_parallel_degree == 2
        assert config.parallelism.data_parallel_shard_degree == 2
        assert config.parallelism.pipeline_parallel_schedule == "1F1B"
    for schedule, name in (("gpipe", "GPipe"), ("interleaved", "Interleaved1F1B"), ("dualpipev", "DualPipeV")):
        config = getattr(config_registry, f"deepseek_v3_debugmodel_pp2_dp2_zero3_{schedule}")()
        assert config.parallelism.pipeline_parallel_schedule == name and config.piper.zero == 3
    assert drop_in("llama3_debugmodel_pp2_dp2_zero2") == ("llama3_debugmodel", "1f1b", 2)
    assert drop_in("llama3_debugmodel_pp2_dualpipev") == ("llama3_debugmodel", "dualpipev", None)
    assert unknown("llama3_debugmodel_pp2_dp2_zero3_interleaved") == ""
    assert "pp2_dp2_zero" in unknown("llama3_debugmode_pp2_dp2_zero3")


def test_zero_flag_parses():
    config = ConfigManager().parse_args(["--module", "piper_plugin.adapters.torchtitan", "--config",
                                         "llama3_debugmodel", "--piper.zero", "2"])
    assert config.piper.zero == 2


def _parallelism(reshard="default"):
    return SimpleNamespace(data_parallel_shard_degree=-1, fsdp_reshard_after_forward=reshard)


def test_the_level_comes_from_torchtitans_knob_or_the_piper_flag():
    """The resolved shard degree counts, not the flag (TorchTitan's -1 means "the ranks left")."""
    assert zero_level(_parallelism(reshard="default"), SimpleNamespace(zero=None), 2) == 3
    assert zero_level(_parallelism(reshard="always"), SimpleNamespace(zero=None), 2) == 3
    assert zero_level(_parallelism(reshard="never"), SimpleNamespace(zero=None), 2) == 2
    assert zero_level(_parallelism(), SimpleNamespace(zero=1), 2) == 1
    assert zero_level(_parallelism(), SimpleNamespace(zero=None), 1) is None
    with pytest.raises(ValueError, match=r"--piper.zero 2 needs --parallelism.data_parallel_shard_degree > 1"):
        zero_level(_parallelism(), SimpleNamespace(zero=2), 1)
    with pytest.raises(ValueError, match=r"--piper.zero 5: the ZeRO level is 0, 1, 2 or 3"):
        zero_level(_parallelism(), SimpleNamespace(zero=5), 2)


def _dims(**degrees):
    values = dict(tp=1, cp=1, ep=1, dp_shard=2, dp_replicate=1)
    values.update(degrees)
    return SimpleNamespace(**values)


@pytest.mark.parametrize("degrees, flag", [
    ({"cp": 2}, "--parallelism.context_parallel_degree 2"),
])
def test_a_mesh_piper_cannot_run_is_refused_by_its_flag(degrees, flag):
    with pytest.raises(ValueError, match=flag.replace(".", r"\.")) as info:
        check_parallelism(_dims(**degrees))
    assert "pipeline_engine torch" in str(info.value)
    check_parallelism(_dims())  # pp x dp_shard runs
    check_parallelism(_dims(dp_replicate=2))  # and replicas of it


def test_expert_parallelism_runs_over_the_whole_shard_group_with_zero_1_or_2():
    check_parallelism(_dims(ep=2), zero=2)
    with pytest.raises(ValueError, match=r"--parallelism.expert_parallel_degree 2 with data_parallel_shard_degree 4"
                                         r".*set --parallelism.expert_parallel_degree 4"):
        check_parallelism(_dims(ep=2, dp_shard=4), zero=2)
    with pytest.raises(ValueError, match=r"with ZeRO-3 .* add --piper.zero 2"):
        check_parallelism(_dims(ep=2), zero=3)
    with pytest.raises(ValueError, match=r"with --piper.zero 0: .* use --piper.zero 2"):
        check_parallelism(_dims(ep=2), zero=0)
    with pytest.raises(ValueError, match=r"pipeline_engine alternate"):
        check_parallelism(_dims(ep=2), zero=2, alternate=True)


def test_expert_parallel_drop_ins_are_reachable():
    assert unknown("deepseek_v3_debugmodel_pp2_ep2_dualpipev") == ""
    config = config_registry.deepseek_v3_debugmodel_pp2_ep2_dualpipev()
    par = config.parallelism
    assert (par.pipeline_parallel_degree, par.data_parallel_shard_degree, par.expert_parallel_degree) == (2, 2, 2)
    assert par.pipeline_parallel_schedule == "DualPipeV" and config.piper.zero == 2
    assert drop_in("deepseek_v3_debugmodel_pp2_ep2_1f1b") is None


def test_the_wide_base_config_is_reachable_and_parameter_heavy():
    assert unknown("llama3_widemodel_pp2_dp2_zero3") == "" and unknown("llama3_widemodel") == ""
    config = config_registry.llama3_widemodel_pp2_dp2_zero3()
    model = config.model_spec.model
    assert model.dim == 1024 and len(model.layers) == 16 and config.piper.zero == 3
    assert model.tok_embeddings.embedding_dim == 1024 and model.lm_head.in_features == 1024


def test_the_deepseek_base_with_plain_cross_entropy_is_reachable():
    """DualPipeV parity needs plain cross-entropy: TorchTitan's engine drops the chunked loss's
    norm.weight gradient of a split last-stage backward (benchmarks.zero_parity uses this base)."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    assert unknown("deepseek_v3_debugmodel_ce_loss_pp2_dp2_zero3_dualpipev") == ""
    stock = config_registry.deepseek_v3_debugmodel()
    config = config_registry.deepseek_v3_debugmodel_ce_loss_pp2_dp2_zero3_dualpipev()
    assert isinstance(stock.loss, ChunkedLossWrapper.Config)
    assert type(config.loss) is CrossEntropyLoss.Config
    assert (config.model_spec.name, config.model_spec.flavor) == (stock.model_spec.name, stock.model_spec.flavor)
    assert config.parallelism.pipeline_parallel_schedule == "DualPipeV" and config.piper.zero == 3


def test_the_memory_split_counts_each_storage_once():
    """--piper.memory_split: parameters, gradients and optimizer state from live tensors; a
    parameter viewing a larger buffer counts the buffer (a ZeRO-1/2 bucket holds it whole)."""
    import torch

    from piper_plugin.adapters.torchtitan.resident import resident_bytes, split_line

    flat = torch.zeros(100)
    a, b = torch.nn.Parameter(flat[:60].view(6, 10)), torch.nn.Parameter(flat[60:].view(4, 10))
    part = torch.nn.Module()
    part.a, part.b = a, b
    part.c = torch.nn.Parameter(torch.zeros(7))
    opt = torch.optim.AdamW([a, b, part.c])
    for p in (a, b, part.c):
        p.grad = torch.ones_like(p)
    opt.step()
    held = resident_bytes([part], SimpleNamespace(optimizers=[opt]))
    assert held == {"params": (100 + 7) * 4, "grads": (60 + 40 + 7) * 4,
                    "optimizer": 2 * (60 + 40 + 7) * 4 + 3 * 4}  # exp_avg, exp_avg_sq, step
    line = split_line(3, 2, held, startup=2**30, peak=2**31)
    assert line.startswith("Piper memory split: rank 3 step 2 params 0.0000GiB") and "peak 2.0000GiB" in line
