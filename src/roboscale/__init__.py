"""roboscale: scale-out training for robot vision-language-action policies."""

__version__ = "0.1.0"
