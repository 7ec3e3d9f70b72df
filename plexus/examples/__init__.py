"""Examples that ship with the package, so that `plexus demo` works from an installed wheel."""
