"""What a deployment looks like: the E-P-D notation, and which node and devices each instance gets."""
