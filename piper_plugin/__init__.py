"""Piper: a programmable distributed-training engine.

    model + annotations --capture--> single-device DAG --directives--> global training DAG
        --scheduler--> per-rank plans --runtime--> workers

``__all__`` is the published API: host adapters, benchmarks and users import these names and
nothing else from the engine.

- annotate regions: :func:`annotate` (inside ``forward``), :func:`annotate_modules` (by name)
- capture: :func:`capture` (traced regions) and :meth:`Program.from_regions` (module regions
  a host cut itself, described by :class:`Region`; :func:`region_memory` measures such regions'
  activations and backward memory on fake tensors, for their ``activation_bytes`` and ``backward``)
- directives: :class:`Schedule`; errors: :class:`DirectiveError`
- recipes: :mod:`piper_plugin.recipes` (``recipes.load(name | file.py | trace.json)``)
- compile: :func:`compile` / :func:`compile_program` -> :class:`Compiled` (program, schedule,
  plan, simulation); its steps: :func:`build_plan` -> :class:`Plan`, :func:`simulate` ->
  :class:`SimResult` (under a :class:`CostModel`: unit costs, FLOPs at a rate, measured or
  calibrated times); a run's measured timelines as a result of the same kind:
  :func:`measured_result`, and the cost model they imply: :func:`measured_costs`, drawn beside
  the simulation by :func:`write_trace` (Chrome trace and timeline PNGs); overlap
  blocks in a measured timeline: :func:`overlap_blocks` (a plan rank's blocks) and
  :func:`block_overlap` (how much of each member's communication ran under another's compute);
  a host's steps as they run: :class:`StepTrace` (a trace folder), read back by
  :func:`read_step_traces` (:class:`TracedSteps`); a calibrated profile (``piper calibrate``,
  read by :func:`read_profile`): its cost model :func:`cost_model`, a plan's region memory as
  it measured them :func:`with_measured_memory`, a plan predicted with both
  :func:`predict_plan` and said in a line :func:`prediction_line`
- run one rank, driven by a host: :class:`Executor` with :class:`ExecutorConfig` (it checks
  the plan hash across ranks as it starts; :func:`check_plan_hash` does so earlier; a host
  running copies of a plan per data replica and TP coordinate lists them with :func:`plan_copies`);
  :class:`ValueSpec` is the shape of a value crossing ranks (:func:`probe_values` finds them);
  :func:`stitch` makes whole parameters (or gradients) by name from every rank's pieces;
  :class:`ParamList` is what an ``optimizer_fn`` receives (the parameters, ``.named()``);
  :class:`MemoryMeter` is the CPU memory meter an executor's state keeps; a host's model code
  hands values off the rank (an expert all-to-all) with :func:`hand_off` inside a
  :class:`PausedForward`, whose pieces become regions of their own
- Piper's own launchers: :class:`Job`, a rank of one (:class:`Worker`), :func:`run` ->
  :class:`RunResult`; :func:`start_ray`; a host framework's own trainer on Ray actors:
  :func:`launch_host` with a :class:`HostRank` subclass; a command whose ranks talk over an
  emulated link (a rate-limited loopback in a private network namespace):
  :func:`run_in_emulated_link`, :func:`inside_link`, :func:`link_bits_per_second`
- errors a caller handles: :class:`UsageError`, :class:`CaptureError`, :class:`PlanError`,
  :class:`PlanMismatch`, :class:`WorkerFailed`, :class:`HandOffError`
"""
from piper_plugin.api.annotate import annotate, annotate_modules
from piper_plugin.api.errors import DirectiveError
from piper_plugin.api.schedule import Schedule
from piper_plugin.ir.activations import region_memory
from piper_plugin.ir.capture import CaptureError, Program, capture
from piper_plugin.ir.graph import Region
from piper_plugin.scheduler.plan import Plan, PlanError, build_plan
from piper_plugin.scheduler.cost import CostModel
from piper_plugin.scheduler.simulate import SimResult, simulate
from piper_plugin.compiler import Compiled, compile, compile_program
from piper_plugin import recipes
from piper_plugin.runtime.executor import Executor, ExecutorConfig, PlanMismatch, check_plan_hash, plan_copies
from piper_plugin.runtime.pieces import stitch
from piper_plugin.runtime.paused_forward import HandOffError, PausedForward, hand_off
from piper_plugin.runtime.optimizers import ParamList
from piper_plugin.runtime.value_specs import ValueSpec, probe_values
from piper_plugin.runtime.job import Job
from piper_plugin.runtime.worker import Worker
from piper_plugin.runtime.memory import MemoryMeter
from piper_plugin.runtime.launch.processes import WorkerFailed
from piper_plugin.runtime.launch.ray_actors import start_ray
from piper_plugin.runtime.launch.host_ranks import HostRank, launch_host
from piper_plugin.runtime.launch.emulated_link import inside_link, link_bits_per_second, run_in_emulated_link
from piper_plugin.training import RunResult, run
from piper_plugin.train_report import measured_costs, measured_result, write_trace
from piper_plugin.overlap_report import block_overlap, overlap_blocks
from piper_plugin.step_trace import StepTrace, TracedSteps, read_step_traces
from piper_plugin.measured_memory import with_measured_memory
from piper_plugin.calibrate import cost_model, predict_plan, prediction_line, read_profile
from piper_plugin.cli_args import UsageError

__all__ = [
    "annotate", "annotate_modules",
    "capture", "Program", "Region", "region_memory",
    "Schedule", "DirectiveError",
    "recipes",
    "compile", "compile_program", "Compiled", "build_plan", "Plan", "simulate", "SimResult", "CostModel",
    "measured_result", "measured_costs", "write_trace", "overlap_blocks", "block_overlap",
    "StepTrace", "TracedSteps", "read_step_traces", "cost_model", "read_profile", "with_measured_memory",
    "predict_plan", "prediction_line",
    "Executor", "ExecutorConfig", "check_plan_hash", "plan_copies", "ValueSpec", "probe_values", "stitch", "ParamList", "MemoryMeter",
    "PausedForward", "hand_off", "HandOffError",
    "Job", "Worker", "run", "RunResult", "start_ray", "HostRank", "launch_host",
    "run_in_emulated_link", "inside_link", "link_bits_per_second",
    "UsageError", "CaptureError", "PlanError", "PlanMismatch", "WorkerFailed",
]
