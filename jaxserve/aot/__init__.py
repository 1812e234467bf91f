"""Ahead-of-time compilation: the engine's programs compiled for a target (an H100 or H200 from
any machine, or this CPU), their serialized executables, and the report on them."""
