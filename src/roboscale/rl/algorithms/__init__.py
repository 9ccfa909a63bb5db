"""RL algorithms, one module each, registered in ``roboscale.configs.rl.ALGORITHMS`` (name -> "module:Class") and
chosen with ``--rl.algorithm=NAME`` (its options: ``--rl.algorithm.*``), as policies are with ``--policy.type``.

An algorithm is a frozen dataclass of its hyperparameters (``roboscale.configs.rl.Algorithm``): what it needs of
the policy (``critic``: PPO's value head, ``value_head_dim`` wide), ``check`` of the options it cannot run with,
the ``advantages`` of one group of episodes (the episodes of one initial state, which a rank always holds whole),
and, with a critic, its ``critic_loss``. The policy-gradient loss itself is the clipped surrogate all of them share
(``roboscale.rl.objective``). A new algorithm is a module here and one line in ``ALGORITHMS``
(``tests/rl/test_algorithms.py`` runs each registered one).
"""
