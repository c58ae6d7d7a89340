"""Mirror of torch's deprecated ``torch.distributed._tensor.device_mesh`` (home: ``spmd.mesh``)."""

from spmd.mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
