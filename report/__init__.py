"""Pictures of plans and epochs (matplotlib, Agg): a step's Gantt chart beside the strongest
baseline's, an epoch's speedup and gap over its steps, and a one-page HTML summary.

Used by ``dcp report`` and by the service's report routes; reads plans, never plans itself
(the timelines come from ``planner.timeline`` on the plan's own cost model). Needs no torch.
"""
