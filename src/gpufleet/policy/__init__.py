"""Pure, clock-injected policies: routing, admission, health, autoscaling, rollout."""
