"""mpcache's protocol, written once: pure state machines (stdlib + attrs; time is an argument)."""
