"""What the tests share: one config factory, the unsplit-model reference, the helpers that start
main.py as a process, a fake docker, network namespaces and the planner's literal costs."""
