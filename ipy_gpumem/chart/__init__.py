"""The live chart: the session's timeline, the background sampler, inline SVG and the widget/HTML/text views."""
