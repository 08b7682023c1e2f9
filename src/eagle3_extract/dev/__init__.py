"""Development-only drivers (make e2e, the upstream-native peer): no user command imports them."""
