"""packaging"""
