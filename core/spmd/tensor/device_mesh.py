"""Mirror of ``torch.distributed.tensor.device_mesh``: ``DeviceMesh`` and ``init_device_mesh`` (home: ``spmd.mesh``)."""

from spmd.mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
