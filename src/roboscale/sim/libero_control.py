"""The OSC_POSE control constants both LIBERO experts share (``libero_experts.PickPlace`` and the skills of
``libero_skills``): gains from metres and radians to action units, and the phase lengths of a grasp."""

GAIN = 20.0  # metres -> action units: 1 is 5 cm a step, so an error of 5 cm saturates
ROTATION_GAIN = 2.0  # radians -> action units: 1 is 0.5 rad a step
BOWL_RIM = 0.05  # a bowl's centre to the middle of its wall
CLOSE_STEPS = 12
OPEN_STEPS = 15
STALL_STEPS = 4
ALIGNED = 0.004  # how well the hand is centred over the object before it descends
