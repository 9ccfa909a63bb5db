"""Scripted skills for LIBERO's ``libero_goal`` and ``libero_10`` tasks, with privileged state.

A task's goal is one BDDL predicate or a conjunction of two or three; each predicate is handled by one skill, a small
phase machine, and a task's expert runs them in sequence (``Sequence``): drawers and knobs first, so that nothing
carried is in the way, pick-and-place next, closing last (a drawer is closed over the bowl put in it). A skill is done
when its predicate holds (LIBERO's own check, ``_eval_predicate``) and the hand is clear; a pick that drops its object
starts over. All skills drive the end-effector with OSC_POSE position deltas saturating at 1 and hold an orientation
(the episode's starting one, or a turned hand for a handle), as ``libero_experts.PickPlace`` does.

- ``PickPlace``: ``In``/``On`` an object or a region. Bowls and mugs, wider than the open gripper, are taken by the
  rim: a side one (+y or -y) away from other objects, or, for a target at the edge of the arm's reach, a near one
  with the hand turned; a rim whose hand column a fixture's part stands in (an open drawer) is passed over. A moka
  pot is taken by its lid's knob. What is held is raised out from under anything over it, carried with its bottom
  over the target's top (a basket's rim), placed by its own position, and released when low enough or when it stops
  going down once lowered. Two things put on one region take places apart.
- ``OpenDrawer``: the hand turned to point at the drawer (fingers vertical) grasps the handle bar from the front and
  pulls along the drawer's slide (from above the finger behind the bar meets the cabinet's top or the drawer above),
  then turns back high before the next skill.
- ``PushClosed``: a drawer pushed in by its handle with the hand turned a quarter and tipped forward; a hinged door
  pushed along its arc (not working yet: the microwave).
- ``TurnOn``: the stove's knob grasped by its grip over the axis and turned with the hand (pushing the grip's end
  wedges the hand after about 0.4 rad; on is 0.5).
- ``Push``: a plate dragged to its region by the closed hand pressed on its floor, re-aimed at the plate on
  every step (pushed by its rim from inside, the 11 g plate tips up over the fingers).

A fixture's predicate that holds already is skipped (a knob let go again can turn back off); predicates undone by a
later step are redone once. Success from the official init states (benchmarks/expert_success.py, 10 episodes each):
libero_goal 93% (9 of 10 tasks at 90-100%; the bowl in the top drawer 30%: the bowl lies partly under the opened
drawer and the task's 300 steps run out), libero_10 87% (9 of 10 at 80-100%; the mug in the microwave 0%: it is
lowered from above onto the microwave's roof, an insertion from the front is not scripted).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from roboscale.errors import ConfigError
from roboscale.sim.libero import ACTION_DIM, LiberoEnv
from roboscale.sim.libero_control import (
    ALIGNED, BOWL_RIM, CLOSE_STEPS, GAIN, OPEN_STEPS, ROTATION_GAIN, STALL_STEPS,
)

LIFT = 0.10  # what is held is carried this far above the target ...
RELEASE = 0.03  # ... and let go this far above it (or where it stops going down)
LOWERED = 0.02  # the hand's descent before it can stall on the target
LOWER_STEPS = 60  # the longest lowering: then it is let go where it is
FAR = 0.68  # a target this far from the robot's base (horizontally) is near the edge of the arm's reach
HAND_FOOTPRINT = np.array([0.03, 0.06])  # the open hand's half extents over a grasp (x, y: the fingers' way)
NUDGE = 0.02  # a grasped object is raised this much before it is moved out from under something
CLEAR = 0.015  # ... and taken this far clear of it
CLEAR_TOP = 0.03  # the held object's bottom over the target's top
SPOT_MARGIN = 0.015  # a place on a shared region: this far inside its edge
NEAR_ASIDE = 0.5  # radians around the bowl from its near rim (and twice that), where that is blocked
HAND_HEIGHT = 0.12  # the hand's top over its grip point
HELD = 0.02  # an object risen this much with the hand is held
ATTEMPTS = 3  # picks before a skill gives up
GRASP_BELOW_TOP = 0.04
RIMMED = ("bowl", "mug")
HANDLED = ("moka_pot",)  # taken by the lid's knob
FINGERTIPS = 0.018  # the open fingers' lowest point below the hand's grip point, and a little room  # wider than the open gripper: taken by the rim
TO_HANDLE = 0.10  # the turned hand's approach, in front of a drawer's handle
PULL = 0.18
TIP = 0.4  # radians a drawer-pushing hand is tipped forward
PUSH_FROM = 0.05  # a drawer is pushed from this far in front of its handle ...
PUSH_PAST = 0.05  # ... towards its handle this far further in
DOOR_PUSH = 0.7  # a door is pushed this far out along it from the hinge ...
DOOR_GAP = 0.05  # ... by the hand coming down this far before it
PUSH_ARRIVED = 0.0075  # a dragged plate this near the region's centre along x and y has arrived
PUSH_PRESS_AT = np.array([-0.015, 0.0, 0.0])  # where the hand presses on a plate, from its centre
PUSH_PRESS = 0.003  # the dragging hand's goal this far below the plate's floor (harder: the plate sticks to the table)
PUSH_LEAD = 0.05  # the dragging hand's goal this far ahead of the plate, towards the region
PUSH_SPEED = 0.6  # of the hand's top speed while dragging
PUSH_SLIPPED = 0.025  # a hand this far from its place on the plate has slipped off it
PUSH_STEPS = 120  # the longest drag before it is started again from above
PUSH_RISE = 0.05  # a hand that slipped rises this far above the plate's rim before pressing on again
PUSH_DRAGS = 4  # drags before the skill gives up
TURN = 0.9  # radians the hand turns a knob: LIBERO's stoves are on from 0.5  # a drawer's travel is 0.16 m: pulled slightly beyond it


class Scene:
    """The privileged view skills share: positions of bodies and sites, joints, LIBERO's predicates."""

    def __init__(self, env: LiberoEnv):
        self.env, self.model, self.data = env, env._model, env._data
        self.domain = env._env.env
        self.bodies = {self.model.body(i).name for i in range(self.model.nbody)}
        self.sites = {self.model.site(i).name for i in range(self.model.nsite)}
        self.colliding = [g for g in range(self.model.ngeom)
                          if self.model.geom_contype[g] + self.model.geom_conaffinity[g] > 0]

    def position(self, name: str) -> np.ndarray:
        """A goal's object (its body) or region (its site), in world coordinates."""
        for body in (f"{name}_main", name):
            if body in self.bodies:
                return np.array(self.data.xpos[self.model.body(body).id])
        if name in self.sites:
            return np.array(self.data.site_xpos[self.model.site(name).id])
        raise ConfigError(f"LIBERO task {self.env.task}: no body or site for the goal's {name!r}")

    def holds(self, predicate: list[str]) -> bool:
        return bool(self.domain._eval_predicate(predicate))

    def joint_of(self, name: str) -> int:
        """The joint that moves a region's drawer (``white_cabinet_1_bottom_region``) or an object's door."""
        if name in self.sites:
            site = self.domain.object_sites_dict[name]
            joints = list(site.joints)
        else:
            joints = list(self.domain.get_object(name).joints)
        if len(joints) != 1:
            raise ConfigError(f"LIBERO task {self.env.task}: {name!r} moves with {len(joints)} joints, not one")
        return self.model.joint(joints[0]).id

    def qpos(self, joint: int) -> float:
        return float(self.data.qpos[self.model.jnt_qposadr[joint]])

    def joint_axis(self, joint: int) -> np.ndarray:
        body = self.model.jnt_bodyid[joint]
        return self.data.xmat[body].reshape(3, 3) @ self.model.jnt_axis[joint]

    def geoms_of(self, body: int) -> list[int]:
        """A body's colliding geoms."""
        return [g for g in range(self.model.ngeom) if self.model.geom_bodyid[g] == body
                and self.model.geom_contype[g] + self.model.geom_conaffinity[g] > 0]

    def geom_box(self, g: int) -> tuple[np.ndarray, np.ndarray]:
        """A geom's world bounding box."""
        if self.model.geom_type[g] == 7:  # a mesh: its own box
            centre = self.data.geom_xmat[g].reshape(3, 3) @ self.model.geom_aabb[g][:3] + self.data.geom_xpos[g]
            size = self.model.geom_aabb[g][3:]
        else:
            centre, size = self.data.geom_xpos[g], self.model.geom_size[g]
        half = np.abs(self.data.geom_xmat[g].reshape(3, 3)) @ size if self.model.geom_type[g] in (6, 7) \
            else np.full(3, self.model.geom_rbound[g])
        return centre - half, centre + half

    def extent(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """An object's world bounding box (its colliding geoms', over all its bodies)."""
        low, high = np.full(3, np.inf), np.full(3, -np.inf)
        for g in self.colliding:
            if self.model.body(self.model.geom_bodyid[g]).name.startswith(name):
                box = self.geom_box(g)
                low, high = np.minimum(low, box[0]), np.maximum(high, box[1])
        if not np.isfinite(low).all():
            raise ConfigError(f"LIBERO task {self.env.task}: no colliding geoms for {name!r}")
        return low, high

    def bodies_in(self, low: np.ndarray, high: np.ndarray, floor: float, ceiling: float, exclude: str) -> list[int]:
        """Bodies (not the robot's, not ``exclude``'s) with a geom in the horizontal box ``low``-``high`` between
        ``floor`` and ``ceiling``."""
        found = set()
        for g in self.colliding:
            body = self.model.geom_bodyid[g]
            if body == 0 or self.model.body(body).name.startswith((exclude, "robot", "gripper", "mount")):
                continue
            box = self.geom_box(g)
            if box[1][2] > floor and box[0][2] < ceiling and np.all(box[0][:2] < high) and np.all(box[1][:2] > low):
                found.add(int(body))
        return sorted(found)

    def overhangs(self, name: str, reach: float) -> list[tuple[np.ndarray, np.ndarray]]:
        """Boxes of the bodies (not the robot's, not ``name``'s) over ``name`` within ``reach`` above its top: an
        open drawer above a bowl. Per body: a cabinet's box would cover its drawers' front too."""
        low, high = self.extent(name)
        boxes: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        for g in self.colliding:
            body = self.model.geom_bodyid[g]
            body_name = self.model.body(body).name
            if body_name.startswith((name, "robot", "gripper", "mount")) or body == 0:
                continue
            box = self.geom_box(g)
            if box[0][2] > low[2] + 0.01 and box[0][2] < high[2] + reach and np.all(box[0][:2] < high[:2]) \
                    and np.all(box[1][:2] > low[:2]):
                old = boxes.get(body, (np.full(3, np.inf), np.full(3, -np.inf)))
                boxes[body] = (np.minimum(old[0], box[0]), np.maximum(old[1], box[1]))
        return list(boxes.values())

    def top(self, name: str) -> float:
        """The top of a target: an object's, or a region's object's (a basket's rim); a drawer's region: its own
        height, the cabinet above it is not in the way once it is open."""
        site = self.domain.object_sites_dict.get(name)
        if site is not None and (getattr(site, "joints", None) or not site.parent_name):
            return float(self.position(name)[2])
        return float(self.extent(site.parent_name if site is not None else name)[1][2])

    def is_drawer(self, region: str) -> bool:
        site = self.domain.object_sites_dict.get(region)
        return site is not None and bool(getattr(site, "joints", None))

    def others(self, exclude: str) -> list[str]:
        """The objects and fixtures but ``exclude``, those with colliding geoms."""
        names = [*self.domain.objects_dict, *getattr(self.domain, "fixtures_dict", {})]
        return [name for name in names if name != exclude and any(
            self.model.body(self.model.geom_bodyid[g]).name.startswith(name) for g in self.colliding)]

    def objects_near(self, exclude: str) -> list[np.ndarray]:
        """The other movable objects' positions: a rim is taken on the side away from them."""
        return [np.array(self.data.xpos[self.domain.obj_body_id[name]]) for name in self.domain.objects_dict
                if name != exclude]


class Hand:
    """A goal position, a grip and an orientation -> the OSC_POSE action (the episode's first orientation held)."""

    def __init__(self):
        self.start: np.ndarray | None = None

    def action(self, raw: dict[str, Any], goal: np.ndarray, grip: float, rotation: np.ndarray | None = None,
               speed: float = 1.0) -> np.ndarray:
        from robosuite.utils.transform_utils import mat2quat, quat2axisangle, quat2mat

        current = quat2mat(raw["robot0_eef_quat"])
        if self.start is None:
            self.start = current
        target = self.start if rotation is None else rotation
        action = np.zeros(ACTION_DIM, dtype=np.float32)
        action[:3] = np.clip(GAIN * (goal - raw["robot0_eef_pos"]), -speed, speed)
        # world frame, as OSC_POSE takes it; noise in the executed actions is corrected, not accumulated
        action[3:6] = np.clip(ROTATION_GAIN * quat2axisangle(mat2quat(target @ current.T)), -1.0, 1.0)
        action[6] = grip
        return action

    def angle_to(self, raw: dict[str, Any], rotation: np.ndarray | None) -> float:
        """Radians between the hand and ``rotation`` (None: the episode's first orientation)."""
        from robosuite.utils.transform_utils import mat2quat, quat2axisangle, quat2mat

        target = self.start if rotation is None else rotation
        if target is None:
            return 0.0
        return float(np.linalg.norm(quat2axisangle(mat2quat(target @ quat2mat(raw["robot0_eef_quat"]).T))))


class Skill:
    """One predicate's phases: ``__call__`` is the next action, ``done`` once the predicate holds and the hand is
    clear."""

    def __init__(self, scene: Scene, hand: Hand, predicate: list[str]):
        self.scene, self.hand, self.predicate = scene, hand, predicate
        self.phase, self.count = "", 0
        self.done = False

    def enter(self, phase: str) -> None:
        self.phase, self.count = phase, 0

    def approach(self, eef: np.ndarray, point: np.ndarray, down_steps: int) -> np.ndarray | None:
        """Phases ``above`` (10 cm over ``point``) then ``down`` (onto it), then ``push``: the goal of whichever
        of the first two this step is in, None in any other phase."""
        goal = None
        if self.phase == "above":
            goal = point + [0, 0, 0.10]
            self.count += 1
            if np.linalg.norm(goal - eef) < 0.015 or self.count > 40 and np.linalg.norm((goal - eef)[:2]) < 0.02:
                self.enter("down")
        if self.phase == "down":
            goal = point
            self.count += 1
            if np.linalg.norm(goal - eef) < 0.01 or self.count > down_steps:
                self.enter("push")
        return goal

    def __call__(self, raw: dict[str, Any]) -> np.ndarray:
        raise NotImplementedError


class PickPlace(Skill):
    """``(In obj region)`` or ``(On obj target)``: pick ``obj`` up, carry it above the target, lower, let go."""

    def __init__(self, scene: Scene, hand: Hand, predicate: list[str], spot: np.ndarray | None = None):
        super().__init__(scene, hand, predicate)
        _, self.obj, self.target_name = predicate
        self.spot = np.zeros(3) if spot is None else spot  # where on the target, from its centre
        self.rimmed = any(word in self.obj for word in RIMMED)
        self.offset = np.zeros(3)
        self.attempts = 0
        self.start_pick()

    def start_pick(self) -> None:
        self.attempts += 1
        self.enter("above_object")
        self.last_z, self.pushed_down = np.inf, False
        self.held = np.zeros(3)  # the hand's offset from the object's position, once lifted
        self.rest_z = self.scene.position(self.obj)[2]
        self.below = self.rest_z - self.scene.extent(self.obj)[0][2]  # its position to its bottom
        # tall things (a bottle, a mug) are taken near the top, low ones just above their base
        top = self.scene.extent(self.obj)[1][2]
        self.grasp_z = max(0.01, top - self.rest_z - GRASP_BELOW_TOP)
        self.above = max(0.12, top - self.rest_z + 0.06)
        self.turn = 0.0  # the hand's turn about the vertical from the episode's orientation (fingers close along y)
        if any(word in self.obj for word in HANDLED):
            self._by_the_knob()
        elif self.rimmed:
            self._by_the_rim()

    def _by_the_rim(self) -> None:
        """A free rim: the side one (-y or +y, fingers across the wall there) away from the other objects, or the
        near one (the hand turned a quarter). The near one first for a far target: held by the side rim the hand
        would be as far out as the target, where the wrist pitches and the elbow locks straight before the hand is
        over it."""
        base, centre = self.scene.position("robot0_base"), self.scene.position(self.obj)
        toward = float(np.arctan2(*(base - centre)[1::-1]))
        # the near rim, or beside it (the hand turned so that the fingers still close across the wall there)
        near = [(BOWL_RIM * np.array([np.cos(toward + d), np.sin(toward + d), 0.0]), toward + d - np.pi / 2)
                for d in (0.0, -NEAR_ASIDE, NEAR_ASIDE, -2 * NEAR_ASIDE, 2 * NEAR_ASIDE)]
        side = self._free_side()
        sides = [(np.array([0.0, s * BOWL_RIM, 0.0]), 0.0) for s in (side, -side)]
        far = np.linalg.norm((self.scene.position(self.target_name) + self.spot - base)[:2]) > FAR
        # a far target's side rim is out of reach when placing: there a near one, even crowded, is the way
        candidates = near if far else [*sides, near[0]]
        free = [c for c in candidates if not self._blocked(centre + c[0], c[1])]
        self.offset, self.turn = (free or candidates)[0]

    def _free_side(self) -> float:
        """The rim side (-1: -y, +1: +y; the fingers close along y, across the wall there) farther from the rest."""
        centre = self.scene.position(self.obj)
        others = [p for p in self.scene.objects_near(self.obj) if np.linalg.norm((p - centre)[:2]) > 0.02]
        room = {}
        for side in (-1.0, 1.0):
            rim = centre + [0.0, side * BOWL_RIM, 0.0]
            room[side] = min((np.linalg.norm((p - rim)[:2]) for p in others), default=np.inf)
        return -1.0 if room[-1.0] >= room[1.0] - 0.02 else 1.0  # -y unless +y is clearly freer

    def _blocked(self, rim: np.ndarray, turn: float) -> bool:
        """Whether a body (a fixture's part: an open drawer's handle, a wine rack) stands in the open hand's
        footprint over ``rim`` higher than the object's bottom: the fingers would come down on it."""
        cos, sin = abs(np.cos(turn)), abs(np.sin(turn))
        footprint = np.array([[cos, sin], [sin, cos]]) @ HAND_FOOTPRINT  # the turned footprint's box
        floor = self.scene.extent(self.obj)[0][2] + 0.02
        ceiling = self.rest_z + self.above + HAND_HEIGHT  # the hand's column from where it starts down
        return bool(self.scene.bodies_in(rim[:2] - footprint, rim[:2] + footprint, floor, ceiling, self.obj))

    def __call__(self, raw: dict[str, Any]) -> np.ndarray:
        eef = raw["robot0_eef_pos"]
        obj_centre = self.scene.position(self.obj)
        obj = obj_centre + self.offset
        target = self.scene.position(self.target_name) + self.spot
        grip, speed = -1.0, 1.0
        if self.phase == "above_object":
            goal = obj + [0, 0, self.above]
            if eef[2] < obj[2] + self.above - 0.06:  # low next to something: up first, then across
                goal = np.array([eef[0], eef[1], obj[2] + self.above])
            elif np.linalg.norm((goal - eef)[:2]) > 0.05:  # across at the hand's height, then down: a slanting
                goal[2] = max(goal[2], eef[2])  # way down from an opened drawer sweeps it closed
            self.count += 1
            # the hand can stay a few millimetres off (OSC's steady error): go down anyway after a while
            aligned = ALIGNED if self.count < 25 else 2 * ALIGNED if self.count < 50 else 4 * ALIGNED
            if np.linalg.norm((goal - eef)[:2]) < aligned and abs(goal[2] - eef[2]) < 0.02:
                self.enter("down")
        if self.phase == "down":
            goal = grasp = obj + [0, 0, self.grasp_z]
            descending = np.linalg.norm((goal - eef)[:2]) <= 3 * ALIGNED
            if not descending:
                goal = np.array([grasp[0], grasp[1], eef[2]])
            low = eef[2] < obj[2] + self.above - 0.03
            stalled = descending and self.pushed_down and low and self.last_z - eef[2] < 0.001
            self.count = self.count + 1 if stalled else 0
            self.last_z, self.pushed_down = eef[2], descending
            if np.linalg.norm(grasp - eef) < 0.01 or self.count >= STALL_STEPS:
                self.enter("close")
        if self.phase == "close":
            goal, grip = obj + [0, 0, self.grasp_z], 1.0
            self.count += 1
            if self.count >= CLOSE_STEPS:
                # fixed at the grasp: measured on the way, a slipping object would raise it without end
                self.lift_to = max(self._carry(target), self.rest_z + LIFT) + max(eef[2] - obj_centre[2], 0.0)
                self.lift_from = eef[2]
                self.aside = eef + self._out_from_under(self.lift_to - eef[2]) + [0, 0, NUDGE]
                self.enter("aside" if not np.allclose(self.aside[:2], eef[:2]) else "lift")
        if self.phase == "aside":  # just off the table, out from under what hangs over it (an opened drawer)
            goal, grip, speed = self.aside, 1.0, 0.5
            self.count += 1
            if np.linalg.norm(goal - eef) < 0.01 or self.count > 30:
                self.enter("lift")
        if self.phase == "lift":
            goal, grip = np.array([eef[0], eef[1], self.lift_to]), 1.0
            slipped = obj_centre[2] < self.rest_z + HELD
            if slipped and eef[2] > self.lift_from + 2 * HELD + 0.03:  # the hand rose without it: take it again
                return self._retry(raw)
            if eef[2] > goal[2] - 0.02:
                if slipped:
                    return self._retry(raw)
                self.held = eef - obj_centre
                self.enter("above_target")
        if self.phase == "above_target":
            height = self._carry(target) + self.held[2]
            goal, grip = np.array([target[0] + self.held[0], target[1] + self.held[1], height]), 1.0
            off = np.linalg.norm((goal - eef)[:2])
            if eef[2] < height - 0.03:  # still rising over the way
                goal[:2] = eef[:2]
            self.count += 1
            if off < 0.01 or self.count > 40 and off < 0.02:
                self.enter("lower")
                # the grasp's last height would read as a stall at once
                self.last_z, self.lowered_from, self.lowering = np.inf, eef[2], 0
        if self.phase == "lower":
            goal, grip = np.array([target[0] + self.held[0], target[1] + self.held[1], target[2] + self.held[2]]), 1.0
            speed = 0.5
            # a heavy thing held by the rim tilts the hand on the way over: while OSC turns it back the hand hardly
            # goes down, which is no stall; one counts only once the hand has come down towards the target
            stalled = self.last_z - eef[2] < 0.001 and eef[2] < self.lowered_from - LOWERED
            self.count = self.count + 1 if stalled else 0
            self.last_z, self.lowering = eef[2], self.lowering + 1
            if obj_centre[2] < target[2] + RELEASE or self.count >= STALL_STEPS or self.lowering > LOWER_STEPS:
                self.enter("release")
        if self.phase == "release":
            goal, grip = eef.copy(), -1.0
            self.count += 1
            if self.count >= OPEN_STEPS:
                self.enter("retreat")
        if self.phase == "retreat":
            goal = np.array([eef[0], eef[1], target[2] + self.held[2] + LIFT])
            if eef[2] > goal[2] - 0.03:
                if self.scene.holds(self.predicate) or self.attempts >= ATTEMPTS:
                    self.done = True
                else:
                    return self._retry(raw)
        return self.hand.action(raw, goal, grip, self._rotation(raw), speed=speed)

    def _by_the_knob(self) -> None:
        """A moka pot: its body is as wide as the open hand (the fingers land on it) and its handle, to one side,
        makes it turn in the fingers; the lid's knob, over its centre, holds its 70 g. The pads take the knob just
        above the fingertips' clearance over the lid."""
        scene = self.scene
        geoms = [g for g in scene.colliding
                 if scene.model.body(scene.model.geom_bodyid[g]).name.startswith(self.obj)]
        knob = max(geoms, key=lambda g: scene.geom_box(g)[1][2])
        low, high = scene.geom_box(knob)
        self.offset = ((low + high) / 2 - scene.position(self.obj)) * [1, 1, 0]
        self.grasp_z = low[2] + FINGERTIPS - self.rest_z

    def _rotation(self, raw: dict[str, Any]) -> np.ndarray | None:
        if self.turn == 0.0:
            return None
        if self.hand.start is None:
            self.hand.action(raw, raw["robot0_eef_pos"], -1.0)  # records the episode's first orientation
        return rotation_z(self.turn) @ self.hand.start

    def _carry(self, target: np.ndarray) -> float:
        """The held object's height (its position) carried over the target: LIFT above it, its bottom clear of the
        target's top (a basket's rim: carried lower, the object pushes the basket along)."""
        top = self.scene.top(self.target_name)
        return max(target[2] + LIFT, top + CLEAR_TOP + self.below)

    def _out_from_under(self, rise: float) -> np.ndarray:
        """The shortest horizontal move (along x or y) taking the object clear of everything over it."""
        low, high = self.scene.extent(self.obj)
        move = np.zeros(3)
        for over_low, over_high in self.scene.overhangs(self.obj, rise):
            options = []
            for axis in (0, 1):
                options.append((over_high[axis] - (low[axis] + move[axis]) + CLEAR, axis))
                options.append((over_low[axis] - (high[axis] + move[axis]) - CLEAR, axis))
            shift, axis = min(options, key=lambda option: abs(option[0]))
            move[axis] += shift
        return move

    def _retry(self, raw: dict[str, Any]) -> np.ndarray:
        if self.attempts >= ATTEMPTS:
            self.done = True
            return self.hand.action(raw, raw["robot0_eef_pos"], -1.0)
        self.start_pick()
        return self(raw)


def rotation_z(angle: float) -> np.ndarray:
    cos, sin = np.cos(angle), np.sin(angle)
    return np.array([[cos, -sin, 0.0], [sin, cos, 0.0], [0.0, 0.0, 1.0]])


def rotation_about(axis: np.ndarray, angle: float) -> np.ndarray:
    from robosuite.utils.transform_utils import quat2mat, axisangle2quat

    return quat2mat(axisangle2quat(axis / np.linalg.norm(axis) * angle))


def turned_hand(direction: np.ndarray) -> np.ndarray:
    """The hand's orientation pointing along ``direction`` (horizontal), fingers vertical: it holds a bar across."""
    z = direction / np.linalg.norm(direction)
    y = np.array([0.0, 0.0, 1.0])
    x = np.cross(y, z)
    return np.stack([x, y, z], axis=1)


class OpenDrawer(Skill):
    """``(Open region)``: grasp the drawer's handle from the front with the hand turned, pull it out."""

    def __init__(self, scene: Scene, hand: Hand, predicate: list[str]):
        super().__init__(scene, hand, predicate)
        self.joint = scene.joint_of(predicate[1])
        # LIBERO's cabinets open at negative positions: the drawer slides along -axis
        self.out = -scene.joint_axis(self.joint)
        body = scene.model.jnt_bodyid[self.joint]
        self.handle_geom = max(scene.geoms_of(body), key=lambda g: float(scene.data.geom_xpos[g] @ self.out))
        self.rotation = turned_hand(-self.out)
        self.enter("over")

    def __call__(self, raw: dict[str, Any]) -> np.ndarray:
        eef = raw["robot0_eef_pos"]
        handle = np.array(self.scene.data.geom_xpos[self.handle_geom])
        grip, speed = -1.0, 1.0
        if self.phase == "over":  # high while the hand turns: turning low, it sweeps what stands on the table
            goal = handle + TO_HANDLE * self.out + [0, 0, 0.12]
            if np.linalg.norm(goal - eef) < 0.02:
                self.enter("approach")
        if self.phase == "approach":
            goal = handle + TO_HANDLE * self.out
            if np.linalg.norm(goal - eef) < 0.01 and self.count > 0:
                self.enter("reach")
            self.count += 1
        if self.phase == "reach":
            goal, speed = handle - 0.005 * self.out, 0.5
            self.count += 1
            # the fingertips may touch the drawer's front before the hand is centred: close where it stops
            if np.linalg.norm(goal - eef) < 0.01 or self.count > 25:
                self.enter("close")
        if self.phase == "close":
            goal, grip = handle - 0.005 * self.out, 1.0
            self.count += 1
            if self.count >= CLOSE_STEPS:
                self.start = handle.copy()
                self.enter("pull")
        if self.phase == "pull":
            goal, grip, speed = self.start + PULL * self.out, 1.0, 0.6
            if self.scene.holds(self.predicate) and np.linalg.norm(goal - eef) < 0.02 or self.count > 60:
                self.enter("release")
            self.count += 1
        if self.phase == "release":
            goal = eef.copy()
            self.count += 1
            if self.count >= OPEN_STEPS // 2:
                self.enter("back")
        rotation = self.rotation
        if self.phase == "back":
            goal = handle + TO_HANDLE * self.out + [0, 0, 0.05]
            if np.linalg.norm(goal - eef) < 0.03:
                self.enter("unturn")
        if self.phase == "unturn":
            # the next skill's turn from here (a quarter-turned grasp) can wind the wrist against the arm: the hand
            # goes back to the episode's orientation first, high, clear of the cabinet
            goal, rotation = handle + TO_HANDLE * self.out + [0, 0, 0.12], None
            self.count += 1
            if self.hand.angle_to(raw, None) < 0.1 and np.linalg.norm(goal - eef) < 0.03 or self.count > 40:
                self.done = True
        return self.hand.action(raw, goal, grip, rotation, speed)


class PushClosed(Skill):
    """``(Close region)``: push an open drawer in by its handle or a hinged door shut (the closed hand beside its
    free end, along the arc). The drawer closes only flush with the cabinet: the hand comes from above turned a
    quarter, its palm's narrow side leading (2.7 cm ahead of the fingertips; the handle stands 3.1 cm out); the
    palm's long side would meet the cabinet 10 cm before the drawer is in."""

    def __init__(self, scene: Scene, hand: Hand, predicate: list[str]):
        super().__init__(scene, hand, predicate)
        self.joint = scene.joint_of(predicate[1])
        self.hinged = scene.model.jnt_type[self.joint] == 3
        body = scene.model.jnt_bodyid[self.joint]
        self.geoms = scene.geoms_of(body)
        if self.hinged:
            self.axis = scene.joint_axis(self.joint)
            # closing is towards positive angles (LIBERO's microwave: open below -1.3, closed from -0.005)
            self.axis = self.axis if scene.model.jnt_range[self.joint][1] <= 0.005 else -self.axis
        else:
            self.out = -scene.joint_axis(self.joint)
            self.handle_geom = max(self.geoms, key=lambda g: float(scene.data.geom_xpos[g] @ self.out))
            # the episode's hand's world +x side turned to lead the push: turned the other way (its narrower side
            # first) the wrist, 8 cm off the hand's axis, leads and the forearm comes down on the cabinet
            self.turn = float(np.arctan2(-self.out[1], -self.out[0]))
        self.enter("above")

    def __call__(self, raw: dict[str, Any]) -> np.ndarray:
        if self.hinged:
            return self._door(raw)
        eef = raw["robot0_eef_pos"]
        if self.hand.start is None:
            self.hand.action(raw, eef, 1.0)  # records the episode's first orientation
        push = -self.out
        # the fingertips tipped forward: the wrist, 20 cm up the hand, keeps the forearm off the cabinet's front
        rotation = rotation_about(np.cross([0.0, 0.0, -1.0], push), TIP) @ rotation_z(self.turn) @ self.hand.start
        handle = np.array(self.scene.data.geom_xpos[self.handle_geom]) + [0, 0, FINGERTIPS / 2]
        grip, speed = 1.0, 1.0
        front = handle + PUSH_FROM * self.out
        goal = self.approach(eef, front, down_steps=30)
        if self.phase == "push":
            goal, speed = handle - PUSH_PAST * self.out, 0.6
            self.count += 1
            if self.scene.holds(self.predicate) or self.count > 60:
                self.enter("back")
        if self.phase == "back":
            goal = eef + 0.05 * self.out + [0, 0, 0.08]
            self.count += 1
            if self.count >= 6:
                self.done = True
        return self.hand.action(raw, goal, grip, rotation, speed)

    def _door(self, raw: dict[str, Any]) -> np.ndarray:
        eef = raw["robot0_eef_pos"]
        anchor = np.array(self.scene.data.xanchor[self.joint])
        # the push point: along the door, most of the way from the hinge to its free edge, at its middle height
        points = np.array([self.scene.data.geom_xpos[g] for g in self.geoms])
        radial = (points - anchor) * [1, 1, 0]
        reach = float(np.max(np.linalg.norm(radial, axis=1)))
        way = radial[np.argmax(np.linalg.norm(radial, axis=1))] / reach
        lows, highs = zip(*(self.scene.geom_box(g) for g in self.geoms))
        height = (min(b[2] for b in lows) + max(b[2] for b in highs)) / 2
        point = anchor + DOOR_PUSH * reach * way
        point[2] = height
        moving = np.cross(self.axis, way)  # where the push point goes as the door closes
        grip, speed = 1.0, 1.0
        behind = point - DOOR_GAP * moving
        if self.phase == "above":
            goal = behind + [0, 0, 0.15]
            self.count += 1
            if np.linalg.norm(goal - eef) < 0.02 or self.count > 40:
                self.enter("down")
        if self.phase == "down":
            goal = behind
            self.count += 1
            if np.linalg.norm(goal - eef) < 0.015 or self.count > 30:
                self.enter("push")
        if self.phase == "push":
            # along the arc: ahead of the hand, at the push point's distance from the hinge
            radius = (eef - anchor) * [1, 1, 0]
            radius = radius / max(np.linalg.norm(radius), 1e-6)
            ahead = np.cross(self.axis, radius)
            goal, speed = anchor + DOOR_PUSH * reach * radius + 0.05 * ahead, 0.6
            goal[2] = height
            self.count += 1
            if self.scene.holds(self.predicate) or self.count > 80:
                self.enter("back")
        if self.phase == "back":
            goal = eef - 0.05 * moving + [0, 0, 0.10]
            self.count += 1
            if self.count >= 8:
                self.done = True
        return self.hand.action(raw, goal, grip, speed=speed)


class TurnOn(Skill):
    """``(Turnon stove)``: grasp the knob's grip over its axis and turn the hand about the vertical."""

    def __init__(self, scene: Scene, hand: Hand, predicate: list[str]):
        super().__init__(scene, hand, predicate)
        self.joint = scene.joint_of(predicate[1])
        self.body = scene.model.jnt_bodyid[self.joint]
        self.enter("above")

    def _grip(self) -> tuple[np.ndarray, np.ndarray]:
        """The bar standing on the knob's disc: the union box of the geoms above it (centre, half extents)."""
        model, data = self.scene.model, self.scene.data
        base = self.scene.data.xanchor[self.joint][2]
        low, high = np.full(3, np.inf), np.full(3, -np.inf)
        for g in self.scene.geoms_of(self.body):
            if data.geom_xpos[g][2] > base + 0.015:
                half = np.abs(data.geom_xmat[g].reshape(3, 3)) @ model.geom_size[g]
                low, high = np.minimum(low, data.geom_xpos[g] - half), np.maximum(high, data.geom_xpos[g] + half)
        return (low + high) / 2, (high - low) / 2

    def __call__(self, raw: dict[str, Any]) -> np.ndarray:
        from robosuite.utils.transform_utils import quat2mat

        eef = raw["robot0_eef_pos"]
        grip, rotation = -1.0, None
        if self.phase == "above":
            centre, half = self._grip()
            # the fingers close along y, across a bar that runs along x; a bar along y: the hand turned a quarter
            start = self.hand.start if self.hand.start is not None else quat2mat(raw["robot0_eef_quat"])
            self.grasp = None if half[0] >= half[1] else rotation_z(np.pi / 2) @ start
            rotation = self.grasp
            along = 0 if self.grasp is None else 1
            self.at = np.array([centre[0], centre[1], centre[2] + half[2] - 0.015])
            self.at[along] = self.scene.data.xanchor[self.joint][along]  # over the axis: the hand turns in place
            goal = self.at + [0, 0, 0.08]
            if np.linalg.norm(goal - eef) < 0.01:
                self.enter("down")
        if self.phase == "down":
            goal, rotation = self.at, self.grasp
            if np.linalg.norm(goal - eef) < 0.008:
                self.enter("close")
        if self.phase == "close":
            goal, grip, rotation = self.at, 1.0, self.grasp
            self.count += 1
            if self.count >= CLOSE_STEPS:
                self.turned = rotation_z(TURN * np.sign(self.scene.joint_axis(self.joint)[2])) @ quat2mat(
                    raw["robot0_eef_quat"])
                self.enter("turn")
        if self.phase == "turn":
            goal, grip, rotation = self.at, 1.0, self.turned
            self.count += 1
            if self.scene.holds(self.predicate) and self.count > 5 or self.count > 40:
                self.enter("release")
        if self.phase == "release":
            goal, rotation = self.at, self.turned
            self.count += 1
            if self.count >= OPEN_STEPS // 2:
                self.enter("up")
        if self.phase == "up":
            goal = self.at + [0, 0, 0.12]
            if eef[2] > goal[2] - 0.03:
                self.done = True
        return self.hand.action(raw, goal, grip, rotation)


TABLE_REGIONS = ("main_table_", "kitchen_table_", "living_room_table_", "study_table_", "floor_")


class Push(Skill):
    """``(On obj region)`` for a flat thing (a plate): the closed hand pressed on its floor drags it to the region.

    LIBERO's plate weighs 11 g and its rim slopes outwards: a hand pushing the rim from inside lifts it over the
    fingertips (the plate tips up and the hand passes under), and behind the plate the arm cannot reach at table
    height. The finger pads' friction (2.0) is twice the plate's on the table (0.95), so a hand pressing on the
    floor carries the plate along. Closed-loop: the hand's goal is re-aimed from where the plate is on every step;
    a plate left behind (the pads slipped) is pressed on again from above."""

    def __init__(self, scene: Scene, hand: Hand, predicate: list[str]):
        super().__init__(scene, hand, predicate)
        _, self.obj, self.region = predicate
        low, high = scene.extent(self.obj)
        self.height = float(high[2])
        self.floor = float(low[2]) + 0.012  # the closed fingertips (1.4 cm below the grip point) on the plate's floor
        self.drags = 0
        self._press_on()

    def _press_on(self) -> None:
        self.drags += 1
        self.enter("above")

    def __call__(self, raw: dict[str, Any]) -> np.ndarray:
        eef = raw["robot0_eef_pos"]
        obj, region = self.scene.position(self.obj), self.scene.position(self.region)
        press = obj + PUSH_PRESS_AT  # on the plate's floor, on its side nearer the robot (within reach)
        press[2] = self.floor
        grip, speed = 1.0, 1.0
        goal = self.approach(eef, press, down_steps=20)
        if self.phase == "push":
            step = (region - obj)[:2]
            step *= min(1.0, PUSH_LEAD / max(float(np.linalg.norm(step)), 1e-6))
            goal = press.copy()
            goal[:2] += step
            goal[2] = self.floor - PUSH_PRESS
            speed = PUSH_SPEED
            self.count += 1
            arrived = np.all(np.abs((region - obj)[:2]) < PUSH_ARRIVED)
            slipped = np.linalg.norm((eef - press)[:2]) > PUSH_SLIPPED  # the plate left behind
            if arrived or slipped or self.count > PUSH_STEPS:
                self.enter("up")  # arrived: done; else pressed on again from above
        if self.phase == "up":
            goal = np.array([eef[0], eef[1], self.height + PUSH_RISE])
            if eef[2] > goal[2] - 0.01:
                if self.scene.holds(self.predicate) or self.drags >= PUSH_DRAGS:
                    self.done = True
                else:
                    self._press_on()
        if self.hand.start is None:
            self.hand.action(raw, eef, grip)  # records the episode's first orientation
        # turned a quarter the palm is 6 cm across, not 20: it passes beside the cabinet behind the plate
        return self.hand.action(raw, goal, grip, rotation_z(np.pi / 2) @ self.hand.start, speed)


SKILLS = {"in": PickPlace, "on": PickPlace, "open": OpenDrawer, "close": PushClosed, "turnon": TurnOn}
STATES = ("turnon", "open", "close")  # predicates on a fixture's joint
REDO = 1  # rounds over the goal's predicates that failed after the last skill
ORDER = {"open": 0, "turnon": 0, "in": 1, "on": 1, "close": 2}


class Sequence:
    """A task's expert: its goal's predicates, one skill each, in turn; then the hand stays still, open."""

    def __init__(self, env: LiberoEnv):
        goal = env._env.env.parsed_problem["goal_state"]
        unknown = [p for p in goal if p[0].lower() not in SKILLS]
        if unknown:
            raise ConfigError(f"LIBERO task {env.task}: no scripted skill for {unknown} (skills: {sorted(SKILLS)})")
        self.scene, self.hand = Scene(env), Hand()
        goal = [[p[0].lower(), *p[1:]] for p in goal]
        # "open the top drawer and put the bowl inside" has only the In: the drawer is opened first
        # (a drawer that starts half open is opened fully first too: the bowl put in would rest on its back)
        opened = [["open", p[2]] for p in goal if p[0] == "in" and self.scene.is_drawer(p[2])
                  and not self.scene.holds(["open", p[2]])]
        self.predicates = sorted(opened + goal, key=lambda p: ORDER[p[0]])  # stable: BDDL order kept
        self.index, self.redone = 0, 0
        self.skill = self._make(self._first_to_do(0))

    def _first_to_do(self, index: int) -> int:
        """A stove already on, a drawer already open or closed is left alone: a knob grasped and let go again can
        turn back off."""
        while index < len(self.predicates) and self.predicates[index][0] in STATES \
                and self.scene.holds(self.predicates[index]):
            index += 1
        self.index = index
        return index

    def _make(self, index: int) -> Skill | None:
        if index >= len(self.predicates):
            # a later step can undo an earlier one (a pot set down nudges the other off the stove): redo it, once
            undone = [i for i, p in enumerate(self.predicates) if not self.scene.holds(p)]
            if not undone or self.redone >= REDO:
                return None
            self.redone += 1
            self.index = index = undone[0]
        predicate = self.predicates[index]
        if predicate[0] == "on" and "plate" in predicate[1] and predicate[2].startswith(TABLE_REGIONS):
            return Push(self.scene, self.hand, predicate)  # a plate is pushed across the table, not lifted
        if predicate[0] == "on":
            return PickPlace(self.scene, self.hand, predicate, self._spot(predicate))
        return SKILLS[predicate[0]](self.scene, self.hand, predicate)

    def _spot(self, predicate: list[str]) -> np.ndarray:
        """Where on a region this object goes: two things put on one region (both moka pots on the stove) take
        places apart along its longer side, the second one put on the first's spot knocks it off."""
        sharing = [p for p in self.predicates if p[0] == "on" and p[2] == predicate[2]]
        site = self.scene.domain.object_sites_dict.get(predicate[2])
        if len(sharing) < 2 or site is None or site.size is None:
            return np.zeros(3)
        size = np.abs(self.scene.data.site_xmat[self.scene.model.site(predicate[2]).id].reshape(3, 3)
                      @ np.asarray(site.size, dtype=float))
        axis = int(np.argmax(size[:2]))
        places = np.linspace(-1.0, 1.0, len(sharing)) * (size[axis] - SPOT_MARGIN)
        spot = np.zeros(3)
        spot[axis] = places[sharing.index(predicate)]
        return spot

    def __call__(self, observation: dict[str, Any]) -> np.ndarray:
        raw = observation["privileged"]
        while self.skill is not None and self.skill.done:
            self.skill = self._make(self._first_to_do(self.index + 1))
        if self.skill is None:
            return self.hand.action(raw, raw["robot0_eef_pos"], -1.0)
        return self.skill(raw)
