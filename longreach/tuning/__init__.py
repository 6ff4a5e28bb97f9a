"""Parameters by measurement on the evaluation: ``longreach tune`` (:mod:`.tune`) and ``longreach calibrate dpe``
(:mod:`.calibrate`)."""
