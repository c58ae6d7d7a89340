"""PrepareModuleInput and PrepareModuleOutput: redistribute activations at a module's boundary."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from spmd.mesh import DeviceMesh
from spmd.tensor.dtensor import DTensor
from spmd.tensor.parallel.style import ParallelStyle, from_dtensor, to_dtensor
from spmd.tensor.placements import Placement


def _as_tuple(layouts: Placement | Sequence[Placement | None] | None) -> tuple[Placement | None, ...] | None:
    if layouts is None:
        return None
    if isinstance(layouts, Placement):
        return (layouts,)
    return tuple(layouts)


class PrepareModuleInput(ParallelStyle):
    """Take each positional (and keyword) input as laid out ``input_layouts`` and redistribute it to the desired layout.

    ``None`` in a position leaves that input alone. Inputs stay DTensors unless ``use_local_output``.
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | Sequence[Placement | None] | None = None,
        desired_input_layouts: Placement | Sequence[Placement | None] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ) -> None:
        self.input_layouts = _as_tuple(input_layouts)
        self.desired_input_layouts = _as_tuple(desired_input_layouts)
        if (self.input_layouts is None) != (self.desired_input_layouts is None) or (
            self.input_layouts is not None and len(self.input_layouts) != len(self.desired_input_layouts or ())
        ):
            raise ValueError("PrepareModuleInput: input_layouts and desired_input_layouts must have one entry per input")
        self.input_kwarg_layouts = dict(input_kwarg_layouts or {})
        self.desired_input_kwarg_layouts = dict(desired_input_kwarg_layouts or {})
        self.use_local_output = use_local_output

    def _convert(self, x: Any, mesh: DeviceMesh, given: Placement | None, desired: Placement | None) -> Any:
        x = to_dtensor(x, mesh, given, desired)
        return x.to_local() if self.use_local_output and isinstance(x, DTensor) else x

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if self.input_layouts is not None:
                desired = self.desired_input_layouts or ()
                converted = [
                    self._convert(a, device_mesh, self.input_layouts[i], desired[i]) if i < len(self.input_layouts) else a
                    for i, a in enumerate(args)
                ]
                args = tuple(converted)
            for name, given in self.input_kwarg_layouts.items():
                if name in kwargs:
                    kwargs[name] = self._convert(kwargs[name], device_mesh, given, self.desired_input_kwarg_layouts.get(name, given))
            return args, kwargs

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class PrepareModuleOutput(ParallelStyle):
    """Take each output as laid out ``output_layouts`` and redistribute it to ``desired_output_layouts``."""

    def __init__(
        self,
        *,
        output_layouts: Placement | Sequence[Placement | None],
        desired_output_layouts: Placement | Sequence[Placement | None],
        use_local_output: bool = True,
    ) -> None:
        self.output_layouts = _as_tuple(output_layouts) or ()
        self.desired_output_layouts = _as_tuple(desired_output_layouts) or ()
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise ValueError("PrepareModuleOutput: output_layouts and desired_output_layouts must have one entry per output")
        self.use_local_output = use_local_output

    def apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod: nn.Module, args: tuple, output: Any) -> Any:
            single = not isinstance(output, tuple)
            outputs = (output,) if single else output
            converted = []
            for i, o in enumerate(outputs):
                if i < len(self.output_layouts) and self.output_layouts[i] is not None:
                    o = to_dtensor(o, device_mesh, self.output_layouts[i], None)
                    o = from_dtensor(o, device_mesh, self.desired_output_layouts[i], self.use_local_output)
                converted.append(o)
            return converted[0] if single else tuple(converted)

        module.register_forward_hook(hook)
        return module
