"""The studies as library code: functions of typed configurations that return typed records; the scripts in
``experiments/`` turn flags into a configuration and write files."""
