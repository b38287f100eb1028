"""The engine's front: the client interface the server holds, the client that starts the engine cores and
talks to them over the wire (messages.py), the router that picks a replica, and placement."""
