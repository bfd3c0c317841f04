"""The swarm simulator: peerd's decision rules at fleet scale, over a fluid model of the links.

``fleet`` runs the batched rules of ``peerd/choice.py`` for every host at once (10,000 hosts);
``policies`` drives the real ``SwarmPolicy`` objects one per host over the same links (small fleets),
so the two can be checked against each other. Both learn what peerd learns, when peerd learns it.
"""
