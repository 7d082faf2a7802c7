"""One report dict -> sharding.log, plan.json and report.html."""
