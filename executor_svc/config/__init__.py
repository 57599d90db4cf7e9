"""Process-wide settings, the lowest floor: the configuration object (``settings``), every
environment variable (``envs``), the numerics mode (``numerics``) and the log format (``logs``).
Imports nothing of the executor."""
