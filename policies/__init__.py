"""Pure scaling policies (DS2 and baselines): no I/O, no clock reads, `now` passed in.

Imports nothing else of keyshift's; the control loop in keyshift.operator calls them.
"""
