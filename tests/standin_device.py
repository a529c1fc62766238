"""The stand-in device, where tests import it (kvtier/bench/standin.py)."""

from kvtier.bench.standin import POISON, StandInDevice, StandInEvent, StandInStream

__all__ = ["POISON", "StandInDevice", "StandInEvent", "StandInStream"]
