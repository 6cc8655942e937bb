"""How far a judge can be trusted: canaries, shadow judges, calibration files and agreement statistics."""
