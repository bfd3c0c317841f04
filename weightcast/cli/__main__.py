from weightcast.cli import entry

entry()
