"""Camera images from a MuJoCo scene, cheaply: no multisampling, shadows or reflections.

The simulators' own renderers draw with 4x MSAA, shadows and reflections, most of a step's cost on a CPU's
software OpenGL (llvmpipe); a policy at 64² gains nothing from them. Each adapter renders through this, only when
a caller will look at the images.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Orient = Callable[[str, np.ndarray], np.ndarray]
"""(simulator camera, MuJoCo's top-row-first frame) -> the image in the adapter's convention."""


class CameraRenderer:
    def __init__(self, model: object, size: int, cameras: dict[str, str], orient: Orient | None = None):
        import mujoco

        self.cameras = dict(cameras)
        self._orient = orient or (lambda camera, image: image)
        self._flags = mujoco.mjtRndFlag
        model.vis.quality.offsamples = 0  # no multisampling; must be set before the renderer exists
        self._renderer = mujoco.Renderer(model, height=size, width=size)

    def render(self, data: object) -> dict[str, np.ndarray]:
        """{our camera name: H x W x 3 uint8} for the scene in ``data``."""
        images = {}
        for name, camera in self.cameras.items():
            self._renderer.update_scene(data, camera=camera)
            self._renderer.scene.flags[self._flags.mjRND_SHADOW] = 0
            self._renderer.scene.flags[self._flags.mjRND_REFLECTION] = 0
            images[name] = np.ascontiguousarray(self._orient(camera, self._renderer.render()))
        return images

    def close(self) -> None:
        self._renderer.close()
