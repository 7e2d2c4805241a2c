"""The top layer: the `statepager` command (cli), doctor, inspect, bench, and the
progress and trace helpers they share. The library never imports it."""
