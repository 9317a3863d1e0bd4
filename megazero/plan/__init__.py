"""The layout planner: memory, bytes moved, pipeline bubble and step time of any GPT-2 layout
on any cluster, from one set of formulas (formulas.py) checked against measured runs.
`python -m megazero.plan --help`."""
