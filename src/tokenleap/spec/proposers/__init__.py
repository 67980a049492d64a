"""Proposers: everything that drafts tokens for the target to verify, behind one protocol (``base.Proposer``)."""
