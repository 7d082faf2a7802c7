"""The plan report: `build` makes the dict (plan.json), `text` the sharding log and console summary,
`html` the page, `files` writes them."""
