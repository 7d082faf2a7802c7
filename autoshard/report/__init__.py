"""One report dict -> sharding.log and plan.json."""
