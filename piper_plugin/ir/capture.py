"""Capture: (model, loss, example inputs) -> regions + the single-device training DAG.

The model and loss are traced once with torch.fx (no weights are touched: sizes come from a
run on fake / meta tensors). Every op carries the tags of the ``annotate`` blocks and
``annotate_modules`` modules it ran under; an untagged op belongs to the region of the op
before it in program order (the first region for ops before any tag). A region is a maximal
run of ops with one tag set, so a stage whose experts sit in the middle has three regions
(``1.0``, ``1.1``, ``1.2``). Parameters are not values: each region that reads a parameter
holds it, and a parameter read by several regions is a tied weight.

Invariants: regions form a DAG through their values (a run only reads earlier runs); every op (but inputs and parameters)
belongs to exactly one region; running the regions in region order on the same inputs
reproduces the traced model bit for bit.
"""
from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from piper_plugin.api.annotate import current_tags, module_tags
from piper_plugin.ir.activations import region_memory
from piper_plugin.ir.graph import DAG, Region, gc_paused
from piper_plugin.ir.nodes import Kind, Node
from piper_plugin.ir.size_probe import probe_sizes

__all__ = ["Program", "capture", "CaptureError"]

_TAGS = "piper_tags"


class CaptureError(ValueError):
    """The model cannot be cut into regions; the message names the op or tag and the fix."""


class _Training(nn.Module):
    """model + loss as one module, so the loss is part of the last region."""

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args: Any) -> torch.Tensor:
        *inputs, target = args
        return self.loss_fn(self.model(*inputs), target)


def _traceable(root: _Training, num_inputs: int) -> _Training:
    """``root`` re-classed with one named forward parameter per input (fx cannot trace ``*args``)."""
    params = [p for p in inspect.signature(root.model.forward).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in params[:num_inputs]]
    names += [f"input{i}" for i in range(len(names), num_inputs)]
    if "target" in names:
        names[names.index("target")] = "model_target"
    signature = ", ".join(names + ["target"])
    scope: dict[str, Any] = {"_Training": _Training}
    exec(f"def forward(self, {signature}):\n    return _Training.forward(self, {signature})", scope)  # noqa: S102
    root.__class__ = type("TrainingStep", (_Training,), {"forward": scope["forward"]})
    return root


_CONTAINERS = (nn.Module, nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _is_torch_layer(cls: type) -> bool:
    return cls.__module__.startswith(("torch.nn.", "torch.ao.nn.")) and cls not in _CONTAINERS


class _TaggingTracer(fx.Tracer):
    """symbolic tracing that records the active Piper tags on each node."""

    def __init__(self) -> None:
        super().__init__()
        self._module_tags: list[dict[str, Any]] = []

    def call_module(self, m: nn.Module, forward: Callable, args: tuple, kwargs: dict) -> Any:
        tags = module_tags(m)
        if tags:
            self._module_tags.append(tags)
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            if tags:
                self._module_tags.pop()

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        """torch.nn's own layers, and subclasses of them without a Piper tag, are one call each:
        a layer that keeps ``nn.Linear``'s contract with a forward fx cannot trace (torchao's
        ``Float8Linear`` casts through tensor subclasses) stays one node, run as itself."""
        if super().is_leaf_module(m, module_qualified_name):
            return True
        return not module_tags(m) and any(_is_torch_layer(base) for base in type(m).__mro__[1:])

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):  # noqa: D102
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        tags: dict[str, Any] = {}
        for frame in self._module_tags:
            tags.update(frame)
        tags.update(current_tags())
        node.meta[_TAGS] = tags
        return node


@dataclass
class Program:
    """The captured model: one fx graph per region, in region order, plus the DAG."""

    graphs: dict[str, fx.Graph]
    regions: dict[str, Region]
    input_names: tuple[str, ...]
    loss_value: str
    loss_region: str
    dag: DAG
    root_type: str = ""
    tied: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def from_regions(cls, regions: dict[str, Region], *, inputs: Sequence[str], loss_value: str, loss_region: str,
                     batch_size: int, param_bytes: dict[str, int], param_shapes: dict[str, tuple[int, ...]],
                     value_shapes: dict[str, tuple[int, ...]], root_type: str = "",
                     routed: Sequence[str] = ()) -> "Program":
        """Module regions: a program over regions the caller cut itself (a host's model parts),
        with no tracing. Each value is produced by the one region listing it in ``outputs``; the
        DAG is the one :func:`capture` builds for the same regions. Sizes are for the whole
        batch. Such a program has no graphs: its class overrides :meth:`instantiate` to return
        each region's chunk module (called with the region's inputs, returning its outputs).
        ``routed``: expert regions taking and returning ``(tokens, counts)`` (``DagMeta.routed``)."""
        if cls.instantiate is Program.instantiate:
            raise TypeError(f"{cls.__name__}.from_regions: a module-region program has no graphs; subclass "
                            f"Program and override instantiate(model, loss_fn) to return each region's chunk")
        producer = {v: name for name, r in regions.items() for v in r.outputs}
        missing = [r.name for r in regions.values() if loss_value in r.outputs and r.name != loss_region]
        if loss_region not in regions or loss_value not in regions[loss_region].outputs or missing:
            raise CaptureError(f"region {loss_region!r} must be the one region producing the loss {loss_value!r}")
        dag = _single_device_dag(regions, producer, inputs, loss_region, batch_size)
        dag.meta.param_bytes = dict(param_bytes)
        dag.meta.param_shapes = dict(param_shapes)
        dag.meta.value_shapes = dict(value_shapes)
        dag.meta.routed = tuple(routed)
        return cls(graphs={}, regions=regions, input_names=tuple(inputs), loss_value=loss_value,
                   loss_region=loss_region, dag=dag, root_type=root_type, tied={})

    def instantiate(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor]) -> dict[str, fx.GraphModule]:
        """Executable chunk modules over ``model``'s own parameters (shared, not copied).

        Each module gets its own copy of the region graph: a module takes ownership of its
        graph, and the program's graphs stay free to ship to workers."""
        root = _Training(model, loss_fn)
        return {name: fx.GraphModule(root, copy.deepcopy(graph), class_name=f"Chunk_{name.replace('.', '_')}")
                for name, graph in self.graphs.items()}


def capture(model: nn.Module, loss_fn: Callable[..., torch.Tensor], example_inputs: Sequence[Any],
            example_target: torch.Tensor, *, memory: bool = True) -> Program:
    """Trace ``loss_fn(model(*example_inputs), example_target)`` into regions and a DAG.

    The model may live on the meta device. The leading dim of the inputs is the batch.
    ``memory=False`` skips measuring each region's saved activations and backward working memory
    (a fake-tensor run of every region): the regions keep the size probe's estimate, for callers
    that never simulate or check memory.
    """
    with gc_paused():
        return _capture(model, loss_fn, example_inputs, example_target, memory)


def _capture(model: nn.Module, loss_fn: Callable[..., torch.Tensor], example_inputs: Sequence[Any],
             example_target: torch.Tensor, measure_memory: bool = True) -> Program:
    root = _Training(model, loss_fn)
    tracer = _TaggingTracer()
    try:
        graph = tracer.trace(_traceable(root, len(example_inputs)))
    except Exception as exc:  # fx reports data-dependent control flow etc.
        raise CaptureError(
            f"cannot trace {type(model).__name__} with torch.fx: {exc}. Piper needs a forward "
            f"without Python control flow on tensor values; or annotate by module name and "
            f"keep such code inside one region."
        ) from exc
    gm = fx.GraphModule(root, graph)
    probe = probe_sizes(gm, model, (*example_inputs, example_target))
    program = _cut(gm, probe.nbytes, probe.views, type(model).__name__, int(example_inputs[0].shape[0]), probe.flops)
    params = dict(gm.named_parameters())
    program.dag.meta.param_bytes = {n: p.numel() * p.element_size() for n, p in params.items()}
    program.dag.meta.param_shapes = {n: tuple(p.shape) for n, p in params.items()}
    program.dag.meta.value_shapes = probe.shapes
    try:
        memory = region_memory(program, model, loss_fn, (*example_inputs, example_target)) if measure_memory else {}
    except Exception:  # noqa: BLE001 - an op fake tensors cannot run: keep the probe's estimate
        memory = {}
    for name, m in memory.items():
        program.regions[name].activation_bytes = m.saved
        program.regions[name].backward = m.backward
    return program


def _assign(gm: fx.GraphModule) -> list[tuple[dict[str, Any], list[fx.Node]]]:
    """Group ops into maximal runs of one tag set (untagged ops join the previous run)."""
    runs: list[tuple[dict[str, Any], list[fx.Node]]] = []
    pending: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        tags = node.meta.get(_TAGS) or {}
        if not tags:
            (runs[-1][1] if runs else pending).append(node)
            continue
        if runs and runs[-1][0] == tags:
            runs[-1][1].append(node)
        else:
            runs.append((tags, pending + [node]))
            pending = []
    if not runs:
        raise CaptureError("the model has no annotated region: wrap parts of forward in "
                           "piper.annotate(PP=<stage>) or tag modules with piper.annotate_modules")
    for tags, nodes in runs:
        if "PP" not in tags or not isinstance(tags["PP"], int):
            raise CaptureError(
                f"op {nodes[0].name!r} has tags {tags} without an integer PP stage; every region "
                f"needs PP=<stage> (nest piper.annotate(EP=...) inside piper.annotate(PP=...))")
    return runs


def _cut(gm: fx.GraphModule, nbytes: dict[str, int], views: set[str], root_type: str, batch: int,
         flops: dict[str, int] | None = None) -> Program:
    flops = flops or {}
    runs = _assign(gm)
    per_stage: dict[int, int] = {}
    for tags, _ in runs:
        per_stage[tags["PP"]] = per_stage.get(tags["PP"], 0) + 1
    seen: dict[int, int] = {}
    owner: dict[fx.Node, str] = {}
    names: list[str] = []
    for tags, nodes in runs:
        stage = tags["PP"]
        k = seen.get(stage, 0)
        seen[stage] = k + 1
        name = str(stage) if per_stage[stage] == 1 else f"{stage}.{k}"
        names.append(name)
        for node in nodes:
            owner[node] = name
    params = dict(gm.named_parameters())
    param_names = set(params)
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    loss_node = output_node.args[0]
    graphs: dict[str, fx.Graph] = {}
    regions: dict[str, Region] = {}
    users_of_param: dict[str, list[str]] = {}
    producer: dict[str, str] = {}
    for index, ((tags, nodes), name) in enumerate(zip(runs, names)):
        graph, inputs, outputs, region_params = _region_graph(gm, nodes, owner, name, loss_node, param_names)
        for p in region_params:
            users_of_param.setdefault(p, []).append(name)
        for value in outputs:
            producer[value] = name
        graphs[name] = graph
        member = set(nodes)
        regions[name] = Region(
            name=name, stage=tags["PP"], index=index, tags=dict(tags), params=region_params,
            inputs=inputs, outputs=outputs,
            value_bytes={v: nbytes.get(v, 0) for v in inputs + outputs},
            activation_bytes=sum(nbytes.get(n.name, 0) for n in member if n.name not in views),
            param_bytes=sum(params[p].numel() * params[p].element_size() for p in region_params),
            flops=2 * batch * sum(params[p].numel() for p in region_params),
            ops=sum(n.op in ("call_function", "call_method", "call_module") for n in nodes),
            matmul_flops=sum(flops.get(n.name, 0) for n in member),
        )
    input_names = tuple(n.name for n in gm.graph.nodes if n.op == "placeholder")
    dag = _single_device_dag(regions, producer, input_names, owner[loss_node], batch)
    tied = {p: tuple(rs) for p, rs in users_of_param.items() if len(rs) > 1}
    return Program(graphs=graphs, regions=regions, input_names=input_names, loss_value=loss_node.name,
                   loss_region=owner[loss_node], dag=dag, root_type=root_type, tied=tied)


def _module_params(gm: fx.GraphModule, node: fx.Node, param_names: set[str]) -> list[str]:
    if node.op == "call_module":
        return [f"{node.target}.{n}" for n, _ in gm.get_submodule(node.target).named_parameters()]
    if node.op == "get_attr":
        return [node.target] if node.target in param_names else []
    return []


def _region_graph(gm, nodes, owner, name, loss_node, param_names):
    """Copy one region's ops into its own graph: other regions' values become placeholders."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    inputs: list[str] = []
    params: list[str] = []

    def lookup(arg: fx.Node) -> fx.Node:
        if arg in env:
            return env[arg]
        if arg.op == "get_attr":
            env[arg] = graph.get_attr(arg.target)
            params.extend(_module_params(gm, arg, param_names))
        else:  # a model input or another region's value
            env[arg] = graph.placeholder(arg.name)
            inputs.append(arg.name)
        return env[arg]

    member = set(nodes)
    for node in nodes:
        for arg in node.all_input_nodes:
            if arg not in member:
                lookup(arg)
        env[node] = graph.node_copy(node, lambda a: env[a])
        params.extend(_module_params(gm, node, param_names))
    outputs = [n.name for n in nodes
               if n is loss_node or any(u not in member and u.op != "output" for u in n.users)]
    exported = set(outputs)
    graph.output(tuple(env[n] for n in nodes if n.name in exported))
    graph.lint()
    return graph, tuple(inputs), tuple(outputs), tuple(dict.fromkeys(params))


def _single_device_dag(regions: dict[str, Region], producer: dict[str, str], input_names,
                       loss_region: str, batch: int) -> DAG:
    """F, B and UPDATE per region; data edges for activations and their gradients."""
    dag = DAG(regions=regions, batch_size=batch)
    for r in regions.values():
        dag.add(Node(Kind.F, r.name, r.stage, tags=r.tags))
    for r in regions.values():
        dag.add(Node(Kind.B, r.name, r.stage, tags=r.tags))
    for r in regions.values():
        if r.params:
            dag.add(Node(Kind.UPDATE, r.name, r.stage, tags=r.tags))
    for r in regions.values():
        f, b = f"{r.name}F", f"{r.name}B"
        dag.add_data(f, b, ("saved",))
        if r.params:
            dag.add_data(b, f"{r.name}UPDATE", ("grads",))
        by_src: dict[str, list[str]] = {}
        for value in r.inputs:
            if value in producer:
                by_src.setdefault(producer[value], []).append(value)
        for src, values in by_src.items():
            dag.add_data(f"{src}F", f, values)
            dag.add_data(b, f"{src}B", tuple(f"grad:{v}" for v in values))
    dag.meta.loss_region = loss_region
    dag.meta.inputs = tuple(input_names)
    return dag
