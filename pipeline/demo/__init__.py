"""`rtrl demo`, by job: config.py (its settings and base model), sim.py (the simulated users),
fleet.py (serving, the fleet, the terminal), report.py (the numbers and the picture), run.py
(the run, top to bottom)."""
