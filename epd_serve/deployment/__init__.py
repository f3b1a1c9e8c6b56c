"""A deployment file read, validated and resolved into every process's launch spec, once."""
