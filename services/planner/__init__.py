"""Pool sizing: a profile of one worker (`profile`), a simulation of the cluster on it
(`simulate`), the replicas per pool for a traffic and latency targets (`plan`), and the
planner that sizes a running cluster's pools (`online`) through an actuator (`actuators`,
`kubernetes`)."""
