"""Lower bounds on a step's time: the simple bounds (``simple``) and the partition LP (``lp``)."""
