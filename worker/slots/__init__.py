"""The model slots a worker serves in and their states: `slot.py` (what a slot holds), `states.py` (the states
and the moves allowed between them, written once), `swapper.py` (the loads, swaps, unloads and drains that
move them). HTTP reaches them through worker/api/slots.py and worker/api/swap.py."""
