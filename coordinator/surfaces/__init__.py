"""Public API surfaces: each parses its own wire format into a `Generation` (validation at the edge,
its own error shape) and turns the relay's internal events back into its own bytes. Everything
behind them (gateway, admission, scheduler, dispatch, relay) knows none of these formats."""
