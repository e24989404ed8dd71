"""ember's protocol edge."""

VERSION = "0.1.0"
