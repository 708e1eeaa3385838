"""The example VM API of RFD 5 and the DNS controller that follows it."""
