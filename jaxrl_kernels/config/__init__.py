"""The public option values (``PolicyLoss``, ...), checked when built."""
