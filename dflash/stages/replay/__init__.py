"""The replay stage: DFlash's greedy draft-verify loop replayed exactly over the references (`loop`), the
drafter's proposals at the anchors it visits (`drafts`), and prompt lookup replayed on the same references as a
yardstick (`prompt_lookup`)."""
