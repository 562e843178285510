-- Q7, highest bid: the bid(s) with the highest price in each tumbling window of 10 s.
WITH windowed AS (SELECT *, event_time // 10000000 * 10000000 AS window_start FROM bid)
SELECT windowed.window_start, auction, bidder, price, event_time
FROM windowed JOIN (
    SELECT window_start, max(price) AS price FROM windowed GROUP BY window_start
) AS top USING (window_start, price)
